"""``python -m fleetlike.launch``: the only place the launcher calls sys.exit."""

import sys

from fleetlike.launch.main import main

if __name__ == "__main__":
    sys.exit(main())

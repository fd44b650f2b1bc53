"""``python -m fleetlike.launch``: the only place the launcher calls sys.exit."""

import sys

from fleetlike.launch.hostrun import cli

if __name__ == "__main__":
    sys.exit(cli())  # the ordinary launcher, or the -np/-H form

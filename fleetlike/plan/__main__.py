"""``python -m fleetlike.plan``: see `fleetlike.plan.cli`."""

import sys

from fleetlike.plan.cli import main

sys.exit(main())

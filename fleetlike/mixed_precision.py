"""``fleetlike.mixed_precision.decorate``: Fleet's way to ask for mixed precision on an optimizer.

The module lives in `fleetlike.fleet.mixed_precision`; this name is kept so every documented import keeps working.
Importing it imports that module and binds this name to the same module object (its state,
patches and private names are one), so nothing is defined twice.
"""

import sys

from fleetlike.fleet import mixed_precision as _module

sys.modules[__name__] = _module

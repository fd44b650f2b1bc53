"""``import fleetlike.auto``: every DDP model of the process averages through fleetlike (the DDP face).

The module lives in `fleetlike.ddp.auto`; this name is kept so every documented import keeps working.
Importing it imports that module and binds this name to the same module object (its state,
patches and private names are one), so nothing is defined twice.
"""

import sys

from fleetlike.ddp import auto as _module

sys.modules[__name__] = _module

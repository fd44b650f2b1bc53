"""``from fleetlike import role_maker``: Fleet's module name for the role makers.

The module lives in `fleetlike.fleet.role_maker`; this name is kept so every documented import keeps working.
Importing it imports that module and binds this name to the same module object (its state,
patches and private names are one), so nothing is defined twice.
"""

import sys

from fleetlike.fleet import role_maker as _module

sys.modules[__name__] = _module

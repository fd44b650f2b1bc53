"""``fleetlike.cc``: Tencent Light's communication names, on the Horovod face.

The module lives in `fleetlike.horovod.light`; this name is kept so every documented import keeps working.
Importing it imports that module and binds this name to the same module object (its state,
patches and private names are one), so nothing is defined twice.
"""

import sys

from fleetlike.horovod import light as _module

sys.modules[__name__] = _module

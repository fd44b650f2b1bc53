"""``fleetlike.calc``: Tencent Light's ``light.calc`` names (``set_cudnn_autotune``, ``FusedOptimizer``).

The module lives in `fleetlike.horovod.light_calc`; this name is Light's import path.
Importing it imports that module and binds this name to the same module object, so nothing
is defined twice.
"""

import sys

from fleetlike.horovod import light_calc as _module

sys.modules[__name__] = _module

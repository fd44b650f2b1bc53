"""``adaptfp16``: TI-ACC's module name of ``MixedPrecision_TrainingPolicy`` (its parameter table's
``adaptfp16.MixedPrecision_TrainingPolicy``).

The module lives in `fleetlike.strategies.amp_policy`; this name is kept so every documented import keeps working.
Importing it imports that module and binds this name to the same module object (its state,
patches and private names are one), so nothing is defined twice.
"""

import sys

from fleetlike.strategies import amp_policy as _module

sys.modules[__name__] = _module

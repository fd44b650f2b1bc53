"""``tiacc_torch_warp``: TI-ACC's module of its PyTorch helpers (``tiacc_training.torch.tiacc_torch_warp``).

A script changes its import to ``from fleetlike import tiacc_torch_warp`` and keeps its calls,
e.g. ``tiacc_torch_warp.MixedPrecision_TrainingPolicy(policy, start_step, hold_step, end_step,
test_interval, test_step)``. The module lives in `fleetlike.strategies.amp_policy`; this name is
bound to the same module object.
"""

import sys

from fleetlike.strategies import amp_policy as _module

sys.modules[__name__] = _module

"""``tiacc_torch_warp``: TI-ACC's module of its PyTorch helpers (``tiacc_training.torch.tiacc_torch_warp``).

A script changes its import to ``from fleetlike import tiacc_torch_warp`` and keeps its calls,
e.g. ``tiacc_torch_warp.MixedPrecision_TrainingPolicy(policy, start_step, hold_step, end_step,
test_interval, test_step)`` (`fleetlike.strategies.amp_policy`).

Example:
    >>> from fleetlike import tiacc_torch_warp
    >>> tiacc_torch_warp.MixedPrecision_TrainingPolicy(0, 10, None, 90).end_time
    90.0
"""

from fleetlike.strategies.amp_policy import MixedPrecision_TrainingPolicy

__all__ = ["MixedPrecision_TrainingPolicy"]

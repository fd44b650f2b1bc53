"""The online tuner: a job picks its gradient communication settings as it runs.

`OnlineTuner` (`fleetlike.tune.tuner`) measures candidate `Setting`\\ s (`fleetlike.tune.space`)
during the first steps and keeps the fastest, agreed by every rank; `requested`
(`fleetlike.tune.request`) says whether a job asked for it. The faces wire it to their
gradient reducer: `fleetlike.strategies.autotune` (Fleet, program and eager), the Horovod
optimizer, the DDP hook.

Example:
    >>> strategy = DistributedStrategy(auto_tune=True)
    >>> model = fleet.distributed_model(model, strategy=strategy)   # tunes during the first steps
"""

from fleetlike.tune.request import AUTOTUNE, AUTOTUNE_LOG, log_path, requested
from fleetlike.tune.space import AllreduceMode, Knob, Setting, fixed_knobs, fixed_reasons, knob_values
from fleetlike.tune.tuner import LOG_COLUMNS, OnlineTuner, Trial
from fleetlike.tune.reform import REFORMED, agreed_after_reform

__all__ = ["AUTOTUNE", "AUTOTUNE_LOG", "AllreduceMode", "Knob", "LOG_COLUMNS", "OnlineTuner", "REFORMED", "Setting",
           "Trial", "agreed_after_reform", "fixed_knobs", "fixed_reasons", "knob_values", "log_path", "requested"]

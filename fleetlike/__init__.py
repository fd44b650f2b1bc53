"""fleetlike: collective-training strategies for PyTorch, in the shape of PaddlePaddle Fleet.

Example (step 1 of the four-step conversion):
    >>> import fleetlike
    >>> from fleetlike import fleet, DistributedStrategy, roles
"""

import importlib
from typing import Any

from fleetlike import roles
from fleetlike.fleet import DistributedOptimizer, fleet, load_inference_model
from fleetlike.program import CPUPlace, CUDAPlace, Executor, Program
from fleetlike.strategies import AdaptiveAmpPolicy, DistributedStrategy, MixedPrecision_TrainingPolicy

#: names of the faces other than Fleet's, imported on first use, so that ``import fleetlike``
#: loads the core and the fleet facade only (not the Horovod face, elastic or the DDP patch)
_LAZY = {
    "adaptfp16": ("fleetlike.adaptfp16", None),
    "calc": ("fleetlike.horovod.light_calc", None),
    "cc": ("fleetlike.horovod.light", None),
    "init_process_group": ("fleetlike.ddp.initialize", "init_process_group"),
    "io": ("fleetlike.io", None),
    "light_init": ("fleetlike.horovod.light", "light_init"),
    "mixed_precision": ("fleetlike.fleet.mixed_precision", None),
    "role_maker": ("fleetlike.fleet.role_maker", None),
    "tiacc_torch_warp": ("fleetlike.tiacc_torch_warp", None),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'fleetlike' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.2.0"

__all__ = [
    "AdaptiveAmpPolicy",
    "adaptfp16",
    "CPUPlace",
    "CUDAPlace",
    "DistributedOptimizer",
    "DistributedStrategy",
    "Executor",
    "MixedPrecision_TrainingPolicy",
    "Program",
    "calc",
    "cc",
    "fleet",
    "init_process_group",
    "io",
    "light_init",
    "load_inference_model",
    "mixed_precision",
    "role_maker",
    "roles",
    "tiacc_torch_warp",
]

"""fleetlike: collective-training strategies for PyTorch, in the shape of PaddlePaddle Fleet.

Example (step 1 of the four-step conversion):
    >>> import fleetlike
    >>> from fleetlike import fleet, DistributedStrategy, roles
"""

from fleetlike import roles
from fleetlike import mixed_precision, role_maker
from fleetlike import cc
from fleetlike.cc import light_init
from fleetlike.fleet import DistributedOptimizer, fleet, load_inference_model
from fleetlike.program import CPUPlace, CUDAPlace, Executor, Program
from fleetlike.strategies import AdaptiveAmpPolicy, DistributedStrategy

__version__ = "0.2.0"

__all__ = [
    "AdaptiveAmpPolicy",
    "CPUPlace",
    "CUDAPlace",
    "DistributedOptimizer",
    "DistributedStrategy",
    "Executor",
    "Program",
    "cc",
    "fleet",
    "light_init",
    "load_inference_model",
    "mixed_precision",
    "role_maker",
    "roles",
]

"""Tencent Light's communication names (seed 000) and its three-line start, on the Horovod face.

(This module is `fleetlike.horovod.light`; ``fleetlike.cc`` is the same module under Light's name.)

Light users write ``light.cc.size()``, ``light.cc.get_distributed_optimizer(optimizer)``,
``light.cc.fusion_allreduce(tensors)`` and decorate their ``main`` with
``@light_init(params={...})``. Here these are thin names over `fleetlike.horovod` (one
implementation, two spellings): change ``from light import light, light_init`` to
``import fleetlike as light; from fleetlike import light_init`` and the script runs.

``light_init(params)`` initialises the process group for the decorated function from whatever
launched it (``python -m fleetlike.launch``, ``mpiexec``, ``torchrun``, Slurm) and shuts it down
when the function returns or raises. ``params`` follows Light: ``training_framework``
("pytorch"; Light's TensorFlow values raise, fleetlike is PyTorch only; "pytorch_ddp" raises
too: it asks for torch.distributed's own default group, which this face does not create),
``enable_optimizations`` (bool; False still trains, with the plain flat allreduce and no fusion
of small gradients) and ``application_scenario`` (a label, one of Light's values).

Example:
    >>> from fleetlike import cc, light_init
    >>> @light_init(params={"training_framework": "pytorch"})
    ... def main():
    ...     opt = cc.get_distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ...     print(cc.rank(), cc.size())
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from fleetlike import horovod as _hvd
from fleetlike.config import DistributedStrategy
from fleetlike.horovod import Adasum, Average, Compression, Sum

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "Sum",
    "allgather",
    "allreduce",
    "broadcast",
    "fusion_allreduce",
    "get_distributed_optimizer",
    "light_init",
    "local_rank",
    "local_size",
    "rank",
    "size",
]

F = TypeVar("F", bound=Callable[..., Any])

_FRAMEWORKS = ("pytorch", "pytorch_ddp", "tensorflow", "tensorflow_keras")
_SCENARIOS = ("default", "TF-CV", "TF-NLP", "Torch-CV", "Torch-NLP", "TF-GAN", "Torch-GAN")
_KEYS = ("training_framework", "enable_optimizations", "application_scenario")


def size() -> int:
    """Number of processes in the job."""
    return _hvd.size()


def rank() -> int:
    """This process's rank."""
    return _hvd.rank()


def local_size() -> int:
    """Number of processes on this node."""
    return _hvd.local_size()


def local_rank() -> int:
    """This process's rank on its node."""
    return _hvd.local_rank()


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: Any = None) -> torch.Tensor:
    """The reduction of ``tensor`` over all ranks (Average by default), as ``hvd.allreduce``."""
    return _hvd.allreduce(tensor, average=average, name=name, compression=compression, op=op)


def fusion_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                     compression: Any = Compression.none, op: Any = None) -> list[torch.Tensor]:
    """The reductions of every tensor of the list, fused into one collective (``hvd.grouped_allreduce``)."""
    return _hvd.grouped_allreduce(list(tensors), average=average, name=name, compression=compression, op=op)


def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along the first dimension (which may differ)."""
    return _hvd.allgather(tensor, name=name)


def broadcast(tensor: torch.Tensor, root_rank: int = 0, name: str | None = None) -> torch.Tensor:
    """``root_rank``'s ``tensor`` on every rank."""
    return _hvd.broadcast(tensor, root_rank, name=name)


def get_distributed_optimizer(optimizer: torch.optim.Optimizer, named_parameters: Any = None,
                              compression: Any = Compression.none, backward_passes_per_step: int = 1,
                              op: Any = Average) -> Any:
    """Light's name for ``hvd.DistributedOptimizer`` (same arguments, same behaviour)."""
    return _hvd.DistributedOptimizer(optimizer, named_parameters=named_parameters, compression=compression,
                                     backward_passes_per_step=backward_passes_per_step, op=op,
                                     strategy=_STATE.get("strategy"))


_STATE: dict[str, Any] = {}


def _check_params(params: Mapping[str, Any] | None) -> dict[str, Any]:
    given = dict(params or {})
    unknown = sorted(set(given) - set(_KEYS))
    if unknown:
        raise KeyError(f"light_init(params=...): unknown key(s) {unknown}; valid keys: {list(_KEYS)}")
    framework = given.get("training_framework", "pytorch")
    if framework not in _FRAMEWORKS:
        raise ValueError(f"light_init: training_framework={framework!r}; choose one of {list(_FRAMEWORKS)}")
    if framework.startswith("tensorflow"):
        raise ValueError(f"light_init: training_framework={framework!r}: fleetlike trains PyTorch models only; "
                         "use 'pytorch'")
    if framework == "pytorch_ddp":
        raise ValueError("light_init: training_framework='pytorch_ddp' asks for torch.distributed's default "
                         "process group (DDP), which fleetlike's Light face does not create; use 'pytorch' with "
                         "fleetlike.cc.get_distributed_optimizer, or fleet.distributed_model for DDP-style training")
    enable = given.get("enable_optimizations", True)
    if not isinstance(enable, bool):
        raise TypeError(f"light_init: enable_optimizations must be a bool, got {enable!r}")
    scenario = given.get("application_scenario", "default")
    if scenario not in _SCENARIOS:
        raise ValueError(f"light_init: application_scenario={scenario!r}; choose one of {list(_SCENARIOS)}")
    return {"training_framework": framework, "enable_optimizations": enable, "application_scenario": scenario}


def light_init(params: Mapping[str, Any] | None = None) -> Callable[[F], F]:
    """Decorate ``main``: the process group is initialised (from the launch environment) before
    it runs and shut down after it returns or raises. See the module docstring for ``params``.

    Example:
        >>> @light_init(params={"training_framework": "pytorch", "application_scenario": "Torch-CV"})
        ... def main(): ...
    """
    settings = _check_params(params)

    def decorate(main: F) -> F:
        if not callable(main):
            raise TypeError(f"light_init decorates a function, got {type(main).__name__}")

        @functools.wraps(main)
        def run(*args: Any, **kwargs: Any) -> Any:
            started = not _hvd.is_initialized()
            strategy = None
            if not settings["enable_optimizations"]:
                strategy = DistributedStrategy()
                strategy.fuse_all_reduce_ops = False
            _STATE["strategy"] = strategy
            _STATE["params"] = settings
            if started:
                _hvd.init()
            try:
                return main(*args, **kwargs)
            finally:
                _STATE.clear()
                if started:
                    _hvd.shutdown()

        return run  # type: ignore[return-value]

    return decorate

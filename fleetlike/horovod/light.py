"""Tencent Light's communication names (seed 000) and its three-line start, on the Horovod face.

(This module is `fleetlike.horovod.light`; ``fleetlike.cc`` is the same module under Light's name.)

Light users write ``light.cc.size()``, ``light.cc.get_distributed_optimizer(optimizer)``,
``light.cc.fusion_allreduce(tensors)`` and decorate their ``main`` with
``@light_init(params={...})``. Here these are thin names over `fleetlike.horovod` (one
implementation, two spellings): change ``from light import light, light_init`` to
``import fleetlike as light; from fleetlike import light_init`` and the script runs.

``light_init(params)`` initialises the process group for the decorated function from whatever
launched it (``python -m fleetlike.launch``, ``mpiexec``, ``torchrun``, Slurm) and shuts it down
when the function returns or raises. ``params`` follows Light:

* ``training_framework``: "pytorch" (the Horovod face: ``light.cc``) or "pytorch_ddp": torch's
  default process group is formed too (`fleetlike.ddp.start`, behind the job's secret), so a DDP
  script whose ``dist.init_process_group`` call was deleted runs, and its DDP models average
  through fleetlike (`fleetlike.auto`); Light's TensorFlow values raise (PyTorch only);
* ``enable_optimizations`` (bool, default True): False trains with nothing of fleetlike's on top:
  plain torch DDP (no `fleetlike.auto`) for "pytorch_ddp", the plain unfused allreduce for
  "pytorch", no scenario settings;
* ``application_scenario``: what the scenario selects (`SCENARIOS`): "Torch-CV" and
  "Torch-GAN" turn cuDNN autotuning on (fixed input shapes: the search pays back), "Torch-NLP"
  fuses gradients into 64 MiB buckets (Light's ``auto_fusion_threshold``; large embedding and
  projection matrices) and leaves autotuning off (each new sequence length would search again),
  "default" changes nothing; the TensorFlow scenarios raise. A setting the environment already
  makes (``FLEETLIKE_FUSION_MB``, ``FLEETLIKE_STRATEGY``'s ``fuse_grad_size_in_MB``) wins; both
  are restored when ``main`` returns.

Example:
    >>> from fleetlike import cc, light_init
    >>> @light_init(params={"training_framework": "pytorch"})
    ... def main():
    ...     opt = cc.get_distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ...     print(cc.rank(), cc.size())
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from fleetlike import horovod as _hvd
from fleetlike.config import DistributedStrategy, envvars
from fleetlike.horovod import Adasum, Average, Compression, Sum
from fleetlike.horovod.light_fusion import DEFAULT_AUTO_FUSION_THRESHOLD, fusion_segments

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "SCENARIOS",
    "Sum",
    "allgather",
    "allgather_object",
    "allreduce",
    "broadcast",
    "broadcast_object",
    "broadcast_variable",
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
_KEYS = ("training_framework", "enable_optimizations", "application_scenario")
_NLP_FUSION_MB = DEFAULT_AUTO_FUSION_THRESHOLD / (1 << 20)

#: what each ``application_scenario`` selects: cuDNN autotuning, gradient bucket size (MiB);
#: None leaves the setting as it is
SCENARIOS: dict[str, dict[str, Any]] = {
    "default": {"cudnn_autotune": None, "fusion_mb": None},
    "Torch-CV": {"cudnn_autotune": True, "fusion_mb": None},
    "Torch-GAN": {"cudnn_autotune": True, "fusion_mb": None},
    "Torch-NLP": {"cudnn_autotune": False, "fusion_mb": _NLP_FUSION_MB},
}
_TF_SCENARIOS = ("TF-CV", "TF-NLP", "TF-GAN")


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


def _no_tf_device(device_dense: str, device_sparse: str) -> None:
    if device_dense or device_sparse:
        raise ValueError(f"device_dense={device_dense!r}, device_sparse={device_sparse!r} are TensorFlow device "
                         "strings; a PyTorch tensor is reduced on its own device: leave them ''")


def fusion_allreduce(grads_and_vars: Sequence[Any], average: bool | None = None, device_dense: str = "",
                     device_sparse: str = "", compression: Any = Compression.none, op: Any = None,
                     fusion_type: str = "auto_fusion", auto_fusion_threshold: int = DEFAULT_AUTO_FUSION_THRESHOLD,
                     piecewise_fusion_schedule: str = "0", scopewise_fusion_schedule: str = "", *,
                     allreduce_type: str = "fusion", name: str | None = None) -> list[Any]:
    """The reduction of every tensor, fused by Light's options (`fleetlike.horovod.light_fusion`):
    each segment is one ``hvd.grouped_allreduce``. ``grads_and_vars``: tensors (their reductions
    come back), or Light's ``(gradient, variable)`` pairs (``(reduced gradient, variable)``
    pairs come back; a variable that is a name string serves ``scopewise_fusion``).

    Example:
        >>> cc.fusion_allreduce([g1, g2, g3], fusion_type="piecewise_fusion", piecewise_fusion_schedule="2")
    """
    _no_tf_device(device_dense, device_sparse)
    items = list(grads_and_vars)
    pairs = bool(items) and all(isinstance(x, tuple) and len(x) == 2 for x in items)
    tensors = [x[0] if pairs else x for x in items]
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fusion_allreduce: entry {i} is a {type(t).__name__}; give tensors or (gradient, variable) pairs")
    names = [x[1] if pairs and isinstance(x[1], str) else None for x in items]
    segments = fusion_segments([t.numel() * t.element_size() for t in tensors], allreduce_type=allreduce_type,
                               fusion_type=fusion_type, auto_fusion_threshold=auto_fusion_threshold,
                               piecewise_fusion_schedule=piecewise_fusion_schedule,
                               scopewise_fusion_schedule=scopewise_fusion_schedule, names=names)
    reduced: list[Any] = [None] * len(tensors)
    for k, segment in enumerate(segments):
        label = None if name is None else f"{name}.{k}"
        outs = _hvd.grouped_allreduce([tensors[i] for i in segment], average=average, name=label,
                                      compression=compression, op=op)
        for i, out in zip(segment, outs):
            reduced[i] = out
    return [(g, x[1]) for g, x in zip(reduced, items)] if pairs else reduced


def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along the first dimension (which may differ)."""
    return _hvd.allgather(tensor, name=name)


def broadcast(tensor: torch.Tensor, root_rank: int = 0, name: str | None = None) -> torch.Tensor:
    """``root_rank``'s ``tensor`` on every rank."""
    return _hvd.broadcast(tensor, root_rank, name=name)


def broadcast_variable(inp: Any, root_rank: int = 0, name: str | None = None) -> None:
    """Overwrite ``inp`` on every rank with ``root_rank``'s, in place, before training starts:
    a tensor, an optimizer (its state and hyper-parameters), a dict (``model.state_dict()``) or
    a list (``model.parameters()`` or ``model.named_parameters()``).

    Example:
        >>> cc.broadcast_variable(model.state_dict(), root_rank=0)
        >>> cc.broadcast_variable(optimizer, root_rank=0)
    """
    if isinstance(inp, torch.Tensor):
        _hvd.broadcast_(inp, root_rank, name=name)
    elif isinstance(inp, torch.optim.Optimizer) or hasattr(inp, "param_groups"):
        _hvd.broadcast_optimizer_state(inp, root_rank)
    elif isinstance(inp, Mapping):
        _hvd.broadcast_parameters(inp, root_rank)
    elif isinstance(inp, (list, tuple)) or hasattr(inp, "__next__"):
        _hvd.broadcast_parameters(list(inp), root_rank)
    else:
        raise TypeError(f"broadcast_variable: inp is a {type(inp).__name__}; give a tensor, an optimizer, a dict "
                        "(model.state_dict()) or a list (model.parameters())")


def _no_session(session: Any) -> None:
    if session is not None:
        raise ValueError("session= is a TensorFlow 1.x session; PyTorch has none: leave it None")


def allgather_object(obj: Any, session: Any = None, name: str | None = None) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (``hvd.allgather_object``)."""
    _no_session(session)
    return _hvd.allgather_object(obj, name=name)


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: str | None = None) -> Any:
    """``root_rank``'s picklable ``obj`` on every rank (``hvd.broadcast_object``)."""
    _no_session(session)
    return _hvd.broadcast_object(obj, root_rank, name=name)


def get_distributed_optimizer(optimizer: torch.optim.Optimizer, named_parameters: Any = None,
                              compression: Any = Compression.none, backward_passes_per_step: int = 1,
                              op: Any = Average, *, allreduce_type: str | None = None,
                              fusion_type: str | None = None, auto_fusion_threshold: int | None = None,
                              piecewise_fusion_schedule: str | None = None,
                              scopewise_fusion_schedule: str | None = None) -> Any:
    """Light's name for ``hvd.DistributedOptimizer`` (same arguments, same behaviour), plus
    Light's fusion options: given, they decide which gradients are reduced together, in the
    optimizer's parameter order (`fleetlike.horovod.light_fusion`); not given, the strategy's
    buckets do (``fuse_grad_size_in_MB``).

    Example:
        >>> opt = cc.get_distributed_optimizer(sgd, fusion_type="auto_fusion", auto_fusion_threshold=1 << 20)
    """
    options = {"allreduce_type": allreduce_type, "fusion_type": fusion_type,
               "auto_fusion_threshold": auto_fusion_threshold,
               "piecewise_fusion_schedule": piecewise_fusion_schedule,
               "scopewise_fusion_schedule": scopewise_fusion_schedule}
    groups = None
    given = {k: v for k, v in options.items() if v is not None}
    if given:
        if not _STATE.get("enable", True) and given.get("allreduce_type", "fusion") != "normal":
            raise ValueError(f"get_distributed_optimizer({', '.join(given)}=...): light_init(params="
                             "{'enable_optimizations': False}) asked for no fusion; drop the fusion options "
                             "or enable the optimizations")
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        by_id = {id(p): n for n, p in (named_parameters or [])} if named_parameters is not None else {}
        if named_parameters is not None:
            named_parameters = [(by_id[id(p)], p) for p in params if id(p) in by_id] or None
        segments = fusion_segments([p.numel() * p.element_size() for p in params],
                                   names=[by_id.get(id(p)) for p in params],
                                   **{k: v for k, v in given.items()})
        groups = [[params[i] for i in segment] for segment in segments]
    return _hvd.DistributedOptimizer(optimizer, named_parameters=named_parameters, compression=compression,
                                     backward_passes_per_step=backward_passes_per_step, op=op, groups=groups,
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
                         "use 'pytorch' or 'pytorch_ddp'")
    enable = given.get("enable_optimizations", True)
    if not isinstance(enable, bool):
        raise TypeError(f"light_init: enable_optimizations must be a bool, got {enable!r}")
    scenario = given.get("application_scenario", "default")
    if scenario in _TF_SCENARIOS:
        raise ValueError(f"light_init: application_scenario={scenario!r} is a TensorFlow scenario and fleetlike "
                         f"trains PyTorch models; choose one of {list(SCENARIOS)}")
    if scenario not in SCENARIOS:
        raise ValueError(f"light_init: application_scenario={scenario!r}; choose one of {list(SCENARIOS)}")
    return {"training_framework": framework, "enable_optimizations": enable, "application_scenario": scenario}


class _Applied:
    """The settings a scenario changed, restored when ``main`` ends."""

    def __init__(self, settings: Mapping[str, Any]) -> None:
        self.effects = SCENARIOS[settings["application_scenario"]] if settings["enable_optimizations"] else {}
        self.cudnn = torch.backends.cudnn.benchmark
        self.fusion_env = os.environ.get(envvars.FUSION_MB)

    def _fusion_mb(self) -> float | None:
        """The scenario's bucket size where the environment sets none itself."""
        mb = self.effects.get("fusion_mb")
        if mb is None or self.fusion_env is not None or os.environ.get(envvars.STRATEGY):
            return None
        return float(mb)

    def apply(self) -> None:
        if self.effects.get("cudnn_autotune") is not None:
            torch.backends.cudnn.benchmark = bool(self.effects["cudnn_autotune"])
        mb = self._fusion_mb()
        if mb is not None:  # read by fleetlike.auto's DDP hook (DDP's bucket_cap_mb)
            os.environ[envvars.FUSION_MB] = f"{mb:g}"

    def strategy(self) -> DistributedStrategy | None:
        """The Horovod face's strategy with the scenario's bucket size (None: the default)."""
        mb = self._fusion_mb()
        if mb is None:
            return None
        strategy = DistributedStrategy()
        strategy.fuse_grad_size_in_MB = mb
        return strategy

    def restore(self) -> None:
        torch.backends.cudnn.benchmark = self.cudnn
        if self.fusion_env is None:
            os.environ.pop(envvars.FUSION_MB, None)
        else:
            os.environ[envvars.FUSION_MB] = self.fusion_env


def light_init(params: Mapping[str, Any] | None = None) -> Callable[[F], F]:
    """Decorate ``main``: the process group is initialised (from the launch environment) before
    it runs and shut down after it returns or raises. See the module docstring for ``params``.

    Example:
        >>> @light_init(params={"training_framework": "pytorch_ddp", "application_scenario": "Torch-NLP"})
        ... def main(): ...
    """
    settings = _check_params(params)

    def decorate(main: F) -> F:
        if not callable(main):
            raise TypeError(f"light_init decorates a function, got {type(main).__name__}")

        @functools.wraps(main)
        def run(*args: Any, **kwargs: Any) -> Any:
            started = not _hvd.is_initialized()
            applied = _Applied(settings)
            applied.apply()
            strategy = applied.strategy()
            if not settings["enable_optimizations"]:
                strategy = DistributedStrategy()
                strategy.fuse_all_reduce_ops = False
            _STATE.update(strategy=strategy, params=settings, enable=settings["enable_optimizations"])
            ddp = settings["training_framework"] == "pytorch_ddp"
            formed = False
            try:
                if started:
                    _hvd.init()
                if ddp:
                    from fleetlike.ddp import initialize, start

                    formed = start.formed() is None
                    initialize.init_process_group(accelerate=settings["enable_optimizations"])
                return main(*args, **kwargs)
            finally:
                _STATE.clear()
                if formed:
                    from fleetlike.ddp import initialize

                    initialize.release()
                if started:
                    _hvd.shutdown()
                applied.restore()

        return run  # type: ignore[return-value]

    return decorate

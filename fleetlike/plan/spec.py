"""The planner's inputs: the cluster's shape, the model builder, the optimizer.

A model builder is a function ``build(batch_size) -> (model, loss_fn, feed)``: the module, the
program-style loss (``loss_fn(model, feed) -> loss``, as ``minimize`` takes it) and one batch
of this rank. ``--model pkg.module:function`` names it; `load_builder` imports it and says
clearly what is wrong when it cannot.

Example:
    >>> cluster = parse_cluster("2x2")                 # 2 nodes x 2 ranks
    >>> spec = ModelSpec(load_builder("bench.plan_models:mlp50m"), 16, OptimizerKind.SGD)
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib
import time
from collections.abc import Callable
from typing import Any

import torch

from fleetlike.comm import parse_choice
from fleetlike.plan.faults import work_faults

__all__ = ["Cluster", "ModelSpec", "OptimizerKind", "load_builder", "model_work", "parse_cluster"]

Builder = Callable[[int], tuple[torch.nn.Module, Callable[..., Any], Any]]


@dataclasses.dataclass(frozen=True)
class Cluster:
    """``nodes`` nodes of ``per_node`` ranks each (consecutive ranks share a node)."""

    nodes: int
    per_node: int

    def __post_init__(self) -> None:
        for name in ("nodes", "per_node"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"cluster {name}={v!r} must be a positive int")

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node

    def __str__(self) -> str:
        return f"{self.nodes} nodes x {self.per_node} ranks"


def parse_cluster(text: str | None = None, *, node_ips: str | None = None, nproc_per_node: int | None = None) -> Cluster:
    """A `Cluster` from ``"NxL"`` (nodes x ranks per node) or from the launcher's flags
    (``--cluster_node_ips=a,b --nproc_per_node=L``). Raises ValueError naming what to write."""
    if text is not None and node_ips is not None:
        raise ValueError("give the cluster either as --cluster NxL or as --cluster_node_ips/--nproc_per_node, not both")
    if node_ips is not None:
        ips = [ip.strip() for ip in node_ips.split(",")]
        if not ips or any(not ip for ip in ips):
            raise ValueError(f"--cluster_node_ips={node_ips!r} has an empty entry; write e.g. 10.0.0.1,10.0.0.2")
        if len(set(ips)) != len(ips):
            raise ValueError(f"--cluster_node_ips={node_ips!r} names a node twice")
        return Cluster(len(ips), int(nproc_per_node or 1))
    if text is None:
        raise ValueError("no cluster given: pass --cluster NxL (e.g. 2x4) or --cluster_node_ips and --nproc_per_node")
    parts = text.lower().replace(" ", "").split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"cluster {text!r} does not parse: write nodes x ranks per node, e.g. '2x4' "
                         "(2 nodes of 4 ranks)")
    return Cluster(int(parts[0]), int(parts[1]))


class OptimizerKind(str, enum.Enum):
    """Optimizers the CLI builds (a library caller may pass any factory to `ModelSpec`)."""

    SGD = "sgd"
    MOMENTUM = "momentum"
    ADAM = "adam"
    ADAMW = "adamw"

    @classmethod
    def parse(cls, value: OptimizerKind | str) -> OptimizerKind:
        return parse_choice(cls, value, what="optimizer", noun="optimizer")

    def factory(self, lr: float = 0.01) -> Callable[[torch.nn.Module], torch.optim.Optimizer]:
        def make(model: torch.nn.Module) -> torch.optim.Optimizer:
            params = model.parameters()
            if self is OptimizerKind.SGD:
                return torch.optim.SGD(params, lr=lr)
            if self is OptimizerKind.MOMENTUM:
                return torch.optim.SGD(params, lr=lr, momentum=0.9)
            if self is OptimizerKind.ADAM:
                return torch.optim.Adam(params, lr=lr)
            return torch.optim.AdamW(params, lr=lr)
        return make


@dataclasses.dataclass
class ModelSpec:
    """A model builder, the per-rank batch size, and how to make the optimizer.

    ``compute_seconds``, where known: seconds of the model's loss and backward (gradients kept
    from the run before) on one rank of the real job while every rank computes (the job can
    time it; `bench.plan_accuracy` does). Each trace then scales its compute by this over the
    same work timed alongside that trace (`Trace.compute_scale`) instead of by
    `Links.compute_scale`: the ratio of two figures taken side by side cancels this machine's
    own drift between traces (the conv net's traced compute moved by 30% within a minute here).

    ``amp_compute_seconds``, where known: the same work with the loss under the autocast of the
    planned strategies' AMP (`model_work` with ``amp``). A trace with AMP scales by that over
    the same autocast work timed alongside it; without it, by ``compute_seconds`` over the
    float32 work. Why a figure of its own: contention slows kinds of compute unequally. On 2
    cores shared by 4 ranks, the float32 models' ratio (x2.5-4.0) put emulated bfloat16 steps
    22-34% over their measured time in five of six cells.
    """

    builder: Builder
    batch_size: int
    optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] = dataclasses.field(
        default_factory=lambda: OptimizerKind.MOMENTUM.factory())
    name: str = "model"
    compute_seconds: float | None = None
    amp_compute_seconds: float | None = None

    def __post_init__(self) -> None:
        for field in ("compute_seconds", "amp_compute_seconds"):
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise ValueError(f"ModelSpec {self.name!r}: {field}={value!r} must be a positive number of "
                                 "seconds (or None to scale by the links' compute_scale)")

    def build(self) -> tuple[torch.nn.Module, Callable[..., Any], Any]:
        out = self.builder(self.batch_size)
        if not (isinstance(out, tuple) and len(out) == 3 and isinstance(out[0], torch.nn.Module) and callable(out[1])):
            raise TypeError(f"model builder {self.name!r} must return (model, loss_fn, feed), got "
                            f"{type(out).__name__}; see fleetlike.plan.spec")
        return out


def model_work(spec: ModelSpec, clock: Callable[[], float] = time.perf_counter,
               fault_seconds: float = 0.0, amp: str | None = None) -> Callable[[], float]:
    """The work ``ModelSpec.compute_seconds`` is the time of: a fresh copy of the model, its
    loss and backward, the gradients of the run before kept (as a bucketed program keeps them,
    so no run allocates them afresh but the first); with ``amp`` ("bfloat16" or "float16") the
    loss under that autocast, as AMP runs it (``amp_compute_seconds``). Returns a function that
    runs it once and returns its seconds on ``clock``, less ``fault_seconds`` per minor page
    fault its work took meanwhile (`fleetlike.plan.faults`: not other threads'). The job times
    it on every rank at once, the planner alongside each trace, both without page faults: the planner's traces leave their faults out
    (`fleetlike.plan.dry`), so the ratio must too (a rank faulting in its 16 MiB temporaries
    made the MLP's ratio x3-6 against x2-3 without)."""
    if amp not in (None, "bfloat16", "float16"):
        raise ValueError(f"model_work amp={amp!r}: write 'bfloat16', 'float16' or None (float32)")
    net, loss_fn, feed = spec.build()
    device = next((p.device.type for p in net.parameters()), "cpu")

    def faults() -> int:
        return work_faults() if fault_seconds else 0

    def run() -> float:
        f0, t0 = faults(), clock()
        with torch.autocast(device, dtype=getattr(torch, amp)) if amp else contextlib.nullcontext():
            loss = loss_fn(net, feed)
        loss.float().backward()
        seconds = clock() - t0 - (faults() - f0) * fault_seconds
        net.zero_grad(set_to_none=False)
        return max(seconds, 0.0)

    return run


def load_builder(path: str) -> Builder:
    """Import ``"pkg.module:function"``; a ValueError says what failed and how to fix it."""
    module_name, sep, attr = str(path).partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model {path!r}: write module:function, e.g. bench.plan_models:mlp50m")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to fix
        raise ValueError(f"--model {path!r}: cannot import module {module_name!r} ({type(exc).__name__}: {exc}); "
                         "check the name and that its directory is on PYTHONPATH") from exc
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        names = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise ValueError(f"--model {path!r}: module {module_name!r} has no function {attr!r}; "
                         f"callables there: {', '.join(names[:20])}")
    return fn

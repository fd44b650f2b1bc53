"""Local SGD and adaptive local SGD: local updates, parameters averaged every k steps.

This unit *replaces* data parallel: the step is purely local (forward, backward, update: no
gradient communication) followed by ``c_localsgd_average``, which averages the parameters over
the ranks when it is due (program style: after the update op of ``main_program``; eager style:
inside ``optimizer.step()``, after the inner update). Communication drops from every step to every k-th,
which pays off when slow ranks or a slow network dominate a step.

Schedule (Paddle 2.x's ``LocalSGDOptimizer``): a step counter starts at 1 and grows by one per run
of ``main_program`` or ``optimizer.step()`` (``_origin_program`` never touches it). Parameters are averaged on every run
while ``step <= begin_step`` (warm-up) and afterwards whenever ``step - last_sync_step == k``,
i.e. at steps ``{1..begin_step} ∪ {begin_step + j*k, j >= 1}``.

Averaging is Paddle's snapshot form, not a plain mean of parameters: every rank keeps a snapshot
of the parameters as they were at the last average (identical on all ranks), allreduces
``(snapshot - param) / N`` and sets ``param = snapshot - mean; snapshot = param``. That equals
the mean of the parameters, but sends the (small) drift, and is what makes the manual recipe of
seed 003 work: ``_origin_program`` steps move the parameters away from the snapshot and the next
``main_program`` run averages them back. Snapshots are flat per-dtype buffers (capped by
``fuse_grad_size_in_MB``) spread round-robin over ``nccl_comm_num`` communicators, all started
asynchronously and then waited for. They are taken by the startup program right after the
broadcast from rank 0 (or lazily at the first step if startup never ran; in eager style the
broadcast is ``fleet.distributed_model``'s).

Adaptive local SGD (Paddle 2.x's ``AdaptiveLocalSGDOptimizer``, after Wang & Joshi,
arXiv:1810.08313): k starts at ``init_k_steps``; at step 1 the loss averaged over the ranks and
the learning rate are recorded as ``loss0``/``lr0``; at each average after ``begin_step``::

    k = clip(ceil(sqrt(lr0 * loss / (lr * loss0) * init_k_steps)), 1, 16)

with ``loss`` this step's loss averaged over the ranks (eager style: pass it as
``optimizer.step(loss=loss)``, or call ``optimizer.backward(loss)``, which records it) and ``lr`` this step's learning rate. So k
*grows* when the learning rate falls faster than the loss (parameters settle: average less often)
and *shrinks* when the loss falls faster than the learning rate. As in Paddle, warm-up averages
(``step <= begin_step``) do not recompute k.

Relation to ``torch.distributed.algorithms.model_averaging.averagers.PeriodicModelAverager``:
torch counts from 0 (its ``step`` is ours minus one) and averages when
``step >= warmup_steps and (step - warmup_steps) % period == 0``, and does nothing at all during
its warm-up (it expects DDP's gradient allreduce there, as ``PostLocalSGDState`` does). With
``period = k`` and ``warmup_steps = begin_step - 1`` the post-warm-up averages coincide (ours at
``begin_step + j*k``, j >= 0, theirs at torch step ``begin_step - 1 + j*k``); our warm-up steps
``1..begin_step - 1`` average parameters where torch relies on gradient averaging, which is the
same for plain SGD from identical parameters. With Paddle's default ``begin_step = 1`` the two
are identical: ``PeriodicModelAverager(period=k, warmup_steps=0)``.

Example:
    >>> s = DistributedStrategy(); s.localsgd = True
    >>> s.localsgd_configs = {"k_steps": 4, "begin_step": 30}
    >>> print(fleet.main_program)       # ... c_localsgd_average k=4 averages=... bytes=...
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from fleetlike.collectives import plan_buckets
from fleetlike.comm import Communicator, dtype_name
from fleetlike.program import Op, StepState
from fleetlike.strategies.step import Hook, StepContext, Unit

__all__ = [
    "K_MIN",
    "K_MAX",
    "LocalSGDState",
    "LocalSGDUnit",
    "ParamAverager",
    "adaptive_k",
]

K_MIN, K_MAX = 1, 16


def adaptive_k(loss0: float, lr0: float, loss: float, lr: float, init_k_steps: int) -> int:
    """Paddle's next k: ``clip(ceil(sqrt(lr0*loss / (lr*loss0) * init_k_steps)), 1, 16)``.

    A ratio that is not a positive finite number (zero loss0 or lr, negative losses, nan) gives
    1 for nan/non-positive (average as often as possible: the safe side) and 16 for +inf.
    """
    den = lr * loss0
    ratio = lr0 * loss / den if den != 0 else (math.inf if lr0 * loss > 0 else math.nan)
    value = ratio * init_k_steps
    if math.isnan(value) or value <= 0:
        return K_MIN
    if math.isinf(value):
        return K_MAX
    return int(min(max(math.ceil(math.sqrt(value)), K_MIN), K_MAX))


class ParamAverager:
    """Snapshot-based parameter averaging over flat per-dtype buffers (see the module docstring)."""

    def __init__(self, params: list[torch.nn.Parameter], rings: list[Communicator], cap_bytes: int | None) -> None:
        if not rings:
            raise ValueError("ParamAverager needs at least one communicator")
        self.rings = rings
        self.groups = plan_buckets(params, cap_bytes)
        self.world = rings[0].size

    def nbytes(self) -> int:
        return sum(sum(p.numel() for p in g) * g[0].element_size() for g in self.groups)

    def flat(self, i: int) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.groups[i]])

    def take_snapshots(self) -> list[torch.Tensor]:
        return [self.flat(i) for i in range(len(self.groups))]

    def average(self, snapshots: list[torch.Tensor]) -> int:
        """Average the parameters in place, refresh ``snapshots``; returns bytes sent."""
        diffs = [snap - self.flat(i) for i, snap in enumerate(snapshots)]
        works = [self.rings[i % len(self.rings)].all_reduce_async(d, "avg", agreed=True) for i, d in enumerate(diffs)]
        for w in works:
            w.wait()
        sent = 0
        with torch.no_grad():
            for group, snap, diff in zip(self.groups, snapshots, diffs):
                snap.sub_(diff)  # snapshot - mean drift: the new (identical) parameters
                offset = 0
                for p in group:
                    p.copy_(snap[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
                sent += diff.numel() * diff.element_size()
        return sent

    def describe(self) -> list[str]:
        out = []
        for i, g in enumerate(self.groups):
            numel = sum(p.numel() for p in g)
            out.append(
                f"buffer={i} params={len(g)} numel={numel} dtype={dtype_name(g[0].dtype)} "
                f"comm={self.rings[i % len(self.rings)].name}"
            )
        return out


class LocalSGDState:
    """Everything the schedule needs to resume exactly: counter, k, snapshots, loss0/lr0, stats."""

    def __init__(self, k: int, begin_step: int, adaptive: bool, init_k_steps: int) -> None:
        self.step = 1
        self.k = k
        self.begin_step = begin_step
        self.adaptive = adaptive
        self.init_k_steps = init_k_steps
        self.last_sync_step = 0
        self.snapshots: list[torch.Tensor] | None = None
        self.loss0: float | None = None
        self.lr0: float | None = None
        self.averages_done = 0
        self.bytes_sent = 0
        #: the buffers' layout (rebuilt from the model, not saved)
        self.averager: ParamAverager | None = None

    def due(self) -> bool:
        """Average at this step? (Paddle: ``step <= begin_step or step - last_step == k``.)"""
        return self.step <= self.begin_step or self.step - self.last_sync_step == self.k

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "k": self.k,
            "begin_step": self.begin_step,
            "adaptive": self.adaptive,
            "init_k_steps": self.init_k_steps,
            "last_sync_step": self.last_sync_step,
            "snapshots": None if self.snapshots is None else [s.clone() for s in self.snapshots],
            "loss0": self.loss0,
            "lr0": self.lr0,
            "averages_done": self.averages_done,
            "bytes_sent": self.bytes_sent,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("begin_step", "adaptive", "init_k_steps"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"local SGD state: saved {key}={state[key]!r} but this job has {getattr(self, key)!r}; "
                    "restart with the saved strategy"
                )
        snaps = state["snapshots"]
        if snaps is not None and self.averager is not None:
            want = [sum(p.numel() for p in g) for g in self.averager.groups]
            got = [s.numel() for s in snaps]
            if want != got:
                raise ValueError(
                    f"local SGD state: saved snapshot buffers have sizes {got}, this model's {want}; "
                    "load a checkpoint of the same model, fuse_grad_size_in_MB and fuse_all_reduce_ops"
                )
        self.snapshots = None if snaps is None else [s.clone() for s in snaps]
        self.step, self.k, self.last_sync_step = int(state["step"]), int(state["k"]), int(state["last_sync_step"])
        self.loss0, self.lr0 = state["loss0"], state["lr0"]
        self.averages_done, self.bytes_sent = int(state["averages_done"]), int(state["bytes_sent"])

    def summary(self) -> str:
        mode = f"adaptive_localsgd init_k_steps={self.init_k_steps}" if self.adaptive else "localsgd"
        return (
            f"{mode}: k={self.k} begin_step={self.begin_step} next_step={self.step} "
            f"averages={self.averages_done} bytes_communicated={self.bytes_sent}"
        )


def _global_lr(optimizer: torch.optim.Optimizer) -> float:
    lrs = {float(g["lr"]) for g in optimizer.param_groups}
    if len(lrs) != 1:
        raise ValueError(
            f"adaptive_localsgd needs one global learning rate, but the optimizer's param_groups have "
            f"lr={sorted(lrs)}; give every param group the same lr (a scheduler may change it) or "
            "use strategy.localsgd with a fixed k_steps"
        )
    return lrs.pop()


def _check_adaptive_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """SGD (with or without momentum, as Paddle's Momentum) is fine; anything else raises."""
    if type(optimizer) is not torch.optim.SGD:
        raise ValueError(
            f"strategy.adaptive_localsgd needs SGD or Momentum (torch.optim.SGD), got "
            f"{type(optimizer).__name__}: k is chosen from the ratio of loss to learning rate, which "
            "measures the step size only when the update is driven by one global lr; Adam-like "
            "optimizers scale every coordinate by their own statistics, so the lr signal is "
            "meaningless. Fix: use torch.optim.SGD (momentum allowed), or strategy.localsgd with a "
            "fixed localsgd_configs.k_steps"
        )
    _global_lr(optimizer)


def _world_mean(comm: Communicator, value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    return float(comm.all_reduce(t, "avg", agreed=True).item())


class LocalSGDUnit(Unit):
    """Local steps; parameters averaged on Paddle's schedule, k adaptive or fixed."""

    needs_optimizer = True

    def __init__(self, ctx: StepContext, adaptive: bool) -> None:
        s = ctx.strategy
        self.name = "adaptive_localsgd" if adaptive else "localsgd"  # type: ignore[misc]
        self.ctx = ctx
        self.adaptive = adaptive
        if adaptive:
            cfg = s.adaptive_localsgd_configs
            self.state = LocalSGDState(int(cfg["init_k_steps"]), int(cfg["begin_step"]), True, int(cfg["init_k_steps"]))
        else:
            cfg = s.localsgd_configs
            self.state = LocalSGDState(int(cfg["k_steps"]), int(cfg["begin_step"]), False, 0)
        self.rings = ctx.groups.rings(s.nccl_comm_num)
        self.averager = ParamAverager([p for p in ctx.model.parameters() if p.requires_grad], self.rings,
                                      s.bucket_cap_bytes())
        self.state.averager = self.averager
        detail = (
            f"replaces data_parallel: {len(self.averager.groups)} parameter buffer(s) over {len(self.rings)} "
            "communicator(s), "
            + (f"k from loss and lr (init {self.state.k}, 1..{K_MAX})" if adaptive else f"k_steps={self.state.k}")
            + f", every step until begin_step={self.state.begin_step}"
        )
        ctx.record(self.name, True, detail)

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        if self.adaptive:
            _check_adaptive_optimizer(optimizer)

    def startup_ops(self) -> list[Op]:
        """Take the snapshots right after the broadcast from rank 0."""

        def take(_: StepState) -> None:
            self.state.snapshots = self.averager.take_snapshots()

        return [Op("localsgd_snapshot", take, {"buffers": len(self.averager.groups)})]

    def hooks(self) -> list[Hook]:
        world = self.ctx.groups.world
        st = self.state
        return [
            Hook("begin", "localsgd_init_snapshot", self._lazy_snapshot, {"when": "first step, if startup did not"}),
            Hook("after_update", "c_localsgd_average", self._average, {
                "k": lambda: st.k,
                "begin_step": st.begin_step,
                "next_step": lambda: st.step,
                "averages": lambda: st.averages_done,
                "bytes": lambda: st.bytes_sent,
                "world": world.size,
            }),
        ]

    def described_ops(self) -> list[Op]:
        return [Op("c_allreduce_avg", None, {"what": f"snapshot-param {d}"}, parent="c_localsgd_average")
                for d in self.averager.describe()]

    def notes(self) -> list[Callable[[], str]]:
        return [self.state.summary]

    def _lazy_snapshot(self, _: StepState) -> None:
        if self.state.snapshots is None:  # startup did not run: snapshot before anything moves
            self.state.snapshots = self.averager.take_snapshots()

    def _loss(self, st: StepState) -> float:
        if st.loss is None:
            raise ValueError(
                f"strategy.adaptive_localsgd chooses k from the loss, but step {self.state.step} had none: "
                "pass it as optimizer.step(loss=loss), or call optimizer.backward(loss) instead of "
                "loss.backward() (program style: loss_fn returns it)"
            )
        return float(st.loss.detach()) if isinstance(st.loss, torch.Tensor) else float(st.loss)

    def _average(self, st: StepState) -> None:
        state, world, device = self.state, self.ctx.groups.world, self.ctx.device
        if st.accumulate:  # a gradient-merge micro-step: no update, no step
            st.info.update(localsgd_k=state.k, localsgd_averaged=False,
                           localsgd_averages=state.averages_done, bytes_communicated=0)
            return
        optimizer = self.ctx.need_optimizer(f"strategy.{self.name}") if self.adaptive else None
        sent = 0
        if optimizer is not None and state.step == 1:
            state.loss0 = _world_mean(world, self._loss(st), device)
            state.lr0 = _global_lr(optimizer)
            sent += 8
        averaged = state.due()
        if averaged:
            if state.snapshots is None:
                raise RuntimeError("local SGD: no parameter snapshot was taken before the first average")
            sent += self.averager.average(state.snapshots)
            if optimizer is not None and state.step > state.begin_step:
                if state.loss0 is None or state.lr0 is None:
                    raise RuntimeError("adaptive local SGD: loss0/lr0 missing (a checkpoint without them?)")
                loss = _world_mean(world, self._loss(st), device)
                sent += 8
                state.k = adaptive_k(state.loss0, state.lr0, loss, _global_lr(optimizer), state.init_k_steps)
                st.info["localsgd_avg_loss"] = loss
            state.last_sync_step = state.step
            state.averages_done += 1
        state.bytes_sent += sent
        state.step += 1
        st.info.update(
            localsgd_k=state.k,
            localsgd_averaged=averaged,
            localsgd_averages=state.averages_done,
            bytes_communicated=sent,
        )

    def state_dict(self) -> dict[str, Any]:
        return self.state.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.load_state_dict(state)

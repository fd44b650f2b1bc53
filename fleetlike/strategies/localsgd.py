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

from fleetlike.collectives import HalfCodec
from fleetlike.comm import Communicator
from fleetlike.program import Op, StepState
from fleetlike.strategies.fragments import Fragment, OuterRule, split_fragments
from fleetlike.strategies.step import Hook, StepContext, Unit
from fleetlike.strategies.topology import averaging_collective, comm_label

__all__ = [
    "K_MIN",
    "K_MAX",
    "LocalSGDState",
    "LocalSGDUnit",
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


class LocalSGDState:
    """Everything the schedule needs to resume exactly: counter, k, the fragments' anchors,
    momentum and a sync in flight, loss0/lr0, stats."""

    def __init__(self, k: int, begin_step: int, adaptive: bool, init_k_steps: int,
                 fragments: list[Fragment], overlap: int = 0) -> None:
        self.step = 1
        self.k = k
        self.begin_step = begin_step
        self.adaptive = adaptive
        self.init_k_steps = init_k_steps
        self.last_sync_step = 0
        self.loss0: float | None = None
        self.lr0: float | None = None
        self.averages_done = 0
        self.bytes_sent = 0
        self.overlap = overlap
        #: the synced units (rebuilt from the model; their anchors and momentum are saved)
        self.fragments = fragments

    @property
    def anchored(self) -> bool:
        return all(f.anchors is not None for f in self.fragments)

    def snapshot(self) -> None:
        for f in self.fragments:
            f.snapshot()

    def warm(self) -> bool:
        """Before (and at) ``begin_step`` every step averages the whole model."""
        return self.step <= self.begin_step

    def due(self) -> bool:
        """Average the whole model at this step? (Paddle: ``step <= begin_step or step -
        last_step == k``; used with one fragment and no overlap.)"""
        return self.warm() or self.step - self.last_sync_step == self.k

    def _period(self) -> int:
        return self.k // len(self.fragments)

    def landing(self) -> int | None:
        """The fragment whose sync lands at this step (fixed k, after warm-up), else None.

        Fragment ``f`` lands at ``t = begin_step + j*k/F`` for ``j = f+1, f+1+F, ...``: F
        fragments staggered k/F apart, each synced every k steps."""
        t, p = self.step - self.begin_step, self._period()
        if t < p or t % p:
            return None
        return (t // p - 1) % len(self.fragments)

    def launching(self) -> int | None:
        """The fragment whose sync starts at this step: ``overlap`` steps before it lands."""
        t, p = self.step - self.begin_step + self.overlap, self._period()
        if self.step <= self.begin_step or t < p or t % p:
            return None
        return (t // p - 1) % len(self.fragments)

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "k": self.k,
            "begin_step": self.begin_step,
            "adaptive": self.adaptive,
            "init_k_steps": self.init_k_steps,
            "last_sync_step": self.last_sync_step,
            "fragments": [f.state_dict() for f in self.fragments],
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
        frags = state.get("fragments")
        if frags is None:  # format of checkpoints before fragments: one "snapshots" list
            frags = [{"anchors": state["snapshots"], "momentum": None, "pending": None}]
        if len(frags) != len(self.fragments):
            raise ValueError(
                f"local SGD state: saved {len(frags)} fragment(s) but this job has {len(self.fragments)}; "
                "restart with the saved localsgd_configs.fragments"
            )
        for frag, saved in zip(self.fragments, frags):
            frag.load_state_dict(saved)
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


_WIRE = {"bfloat16": torch.bfloat16, "float16": torch.float16}


class LocalSGDUnit(Unit):
    """Local steps; the model synced on Paddle's schedule (k adaptive or fixed), averaged or
    stepped by an outer optimizer (DiLoCo), whole or in staggered, overlapped fragments."""

    needs_optimizer = True

    def __init__(self, ctx: StepContext, adaptive: bool) -> None:
        s = ctx.strategy
        self.name = "adaptive_localsgd" if adaptive else "localsgd"  # type: ignore[misc]
        self.ctx = ctx
        self.adaptive = adaptive
        cfg = s.adaptive_localsgd_configs if adaptive else s.localsgd_configs
        self.rule = OuterRule(str(cfg["outer_optimizer"]), float(cfg["outer_lr"]), float(cfg["outer_momentum"]))
        sync_dtype = str(cfg["sync_dtype"])
        codec = HalfCodec(sync_dtype) if sync_dtype in _WIRE else None
        option = f"{self.name}_configs.sync_dtype"
        count = 1 if adaptive else int(cfg["fragments"])
        self.overlap = 0 if adaptive else int(cfg["overlap"])
        # an overlapped sync stays in flight while the main thread issues other collectives
        # (barriers, AMP's finite flag, a loss mean): it gets communicators of its own
        own = None
        if self.overlap:
            rank = ctx.groups.world.rank
            own = [c for i in range(int(s.nccl_comm_num))
                   if (c := ctx.groups.extra(f"localsgd ring {i}", 0, rank)) is not None]
        self.collective, notes = averaging_collective(s, ctx.groups, ctx.role, codec=codec, codec_option=option,
                                                      rings=own)
        self.alpha = 0.0 if adaptive else float(cfg["overlap_alpha"])
        params = [p for p in ctx.model.parameters() if p.requires_grad]
        frags = split_fragments(params, count, self.collective, s.bucket_cap_bytes(params), _WIRE.get(sync_dtype))
        k = int(cfg["init_k_steps"] if adaptive else cfg["k_steps"])
        self.state = LocalSGDState(k, int(cfg["begin_step"]), adaptive, k if adaptive else 0, frags, self.overlap)
        rings = ctx.groups.rings(s.nccl_comm_num)
        buffers = sum(len(f.groups) for f in frags)
        outer = ("average (Paddle)" if self.rule.kind == "average" else
                 f"{self.rule.kind} outer step lr={self.rule.lr:g} momentum={self.rule.momentum:g} (DiLoCo)")
        detail = (
            f"replaces data_parallel: {buffers} parameter buffer(s) over {len(rings)} communicator(s), "
            + (f"k from loss and lr (init {k}, 1..{K_MAX})" if adaptive else f"k_steps={k}")
            + f", every step until begin_step={self.state.begin_step}; outer: {outer}"
            + (f"; {count} fragments synced {k // count} steps apart" if count > 1 else "")
            + (f", each overlapping {self.overlap} inner step(s) (alpha={self.alpha:g})" if self.overlap else "")
        )
        ctx.record(self.name, True, detail)
        for name, applied, why in notes:
            ctx.record(name, applied, why)

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        if self.adaptive:
            _check_adaptive_optimizer(optimizer)

    def startup_ops(self) -> list[Op]:
        """Take the anchors right after the broadcast from rank 0."""

        def take(_: StepState) -> None:
            self.state.snapshot()

        return [Op("localsgd_snapshot", take, {"fragments": len(self.state.fragments)})]

    def hooks(self) -> list[Hook]:
        world = self.ctx.groups.world
        st = self.state
        attrs: dict[str, Any] = {
            "k": lambda: st.k,
            "begin_step": st.begin_step,
            "next_step": lambda: st.step,
            "averages": lambda: st.averages_done,
            "bytes": lambda: st.bytes_sent,
            "world": world.size,
        }
        if self.rule.kind != "average":
            attrs["outer"] = f"{self.rule.kind}(lr={self.rule.lr:g}, momentum={self.rule.momentum:g})"
        if len(st.fragments) > 1 or self.overlap:
            attrs["fragments"] = len(st.fragments)
            attrs["overlap"] = self.overlap
        return [
            Hook("begin", "localsgd_init_snapshot", self._lazy_snapshot, {"when": "first step, if startup did not"}),
            Hook("after_update", "c_localsgd_average", self._average, attrs),
        ]

    def described_ops(self) -> list[Op]:
        op = "c_allreduce_avg" if self.rule.kind == "average" else "c_allreduce_avg_pseudograd"
        return [Op(op, None, {"what": f"anchor-param {d}"}, parent="c_localsgd_average")
                for f in self.state.fragments for d in f.describe(lambda i: comm_label(self.collective, i))]

    def notes(self) -> list[Callable[[], str]]:
        return [self.state.summary]

    def _lazy_snapshot(self, _: StepState) -> None:
        if not self.state.anchored:  # startup did not run: anchor before anything moves
            self.state.snapshot()

    def _loss(self, st: StepState) -> float:
        if st.loss is None:
            raise ValueError(
                f"strategy.adaptive_localsgd chooses k from the loss, but step {self.state.step} had none: "
                "pass it as optimizer.step(loss=loss), or call optimizer.backward(loss) instead of "
                "loss.backward() (program style: loss_fn returns it)"
            )
        return float(st.loss.detach()) if isinstance(st.loss, torch.Tensor) else float(st.loss)

    def _sync_whole(self, rule: OuterRule) -> int:
        """Every fragment launched, then landed (no overlap): the whole model in one sync."""
        sent = sum(f.launch() for f in self.state.fragments)
        for f in self.state.fragments:
            f.land(rule, 0.0, overlapped=False)
        return sent

    def _average(self, st: StepState) -> None:
        state, world, device = self.state, self.ctx.groups.world, self.ctx.device
        if st.accumulate:  # a gradient-merge micro-step: no update, no step
            st.info.update(localsgd_k=state.k, localsgd_averaged=False,
                           localsgd_averages=state.averages_done, bytes_communicated=0)
            return
        if not state.anchored:
            raise RuntimeError("local SGD: no parameter anchor was taken before the first sync")
        optimizer = self.ctx.need_optimizer(f"strategy.{self.name}") if self.adaptive else None
        sent = 0
        if optimizer is not None and state.step == 1:
            state.loss0 = _world_mean(world, self._loss(st), device)
            state.lr0 = _global_lr(optimizer)
            sent += 8
        averaged = False
        if state.warm():  # warm-up: plain averages of the whole model, as Paddle's
            sent += self._sync_whole(OuterRule("average"))
            averaged = True
        elif len(state.fragments) == 1 and not self.overlap:
            if state.due():
                sent += self._sync_whole(self.rule)
                averaged = True
        else:
            landing = state.landing()
            if landing is not None:
                frag = state.fragments[landing]
                if not frag.in_flight:  # overlap 0: launched and landed at once
                    sent += frag.launch()
                frag.land(self.rule, self.alpha, overlapped=self.overlap > 0)
                averaged = True
            launching = state.launching() if self.overlap else None
            if launching is not None:
                sent += state.fragments[launching].launch()
        if averaged:
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

"""``hvd.DistributedOptimizer``: Horovod's optimizer wrapper on fleetlike's gradient reducer.

Gradients are averaged in fused buckets that start while ``loss.backward()`` is still running
(`fleetlike.collectives.GradReducer`, the machinery of fleetlike's data parallel strategy, built
by `make_reducer`; its hook is the only one on each parameter: the optimizer is the reducer's
`PassGate`, counting backward passes in the core's `Accumulation`), so
the `DistributedStrategy` given to ``hvd.init(strategy=...)`` or ``fleet.init`` (or
``FLEETLIKE_STRATEGY``) tunes it as it tunes Fleet: ``fuse_grad_size_in_MB``,
``nccl_comm_num``, ``use_hierarchical_allreduce``, ``fp16_allreduce``. ``compression=
hvd.Compression.fp16`` (or ``bf16``) turns on the 16-bit wire of ``fp16_allreduce``.

Horovod's rules, from ``horovod/torch/optimizer.py``:

- the k-th backward (``backward_passes_per_step=k``) communicates; the k-1 before accumulate
  locally; one more before ``step()`` raises; the gradients are the sum of the k passes,
  averaged over ranks (not divided by k);
- ``step()`` synchronizes first (waits; reduces the current gradients if no backward did);
  ``synchronize()`` then ``with optimizer.skip_synchronize(): optimizer.step()`` lets a loop
  clip or unscale (``GradScaler``) the averaged gradients in between;
- ``zero_grad()`` after ``backward()`` and before ``step()`` / ``synchronize()`` raises
  Horovod's error (the reductions of that backward are not consumed yet);
- ``op``: Average (default), Sum or Adasum (Adasum reduces the update, see `AdasumOptimizer`);
  ``gradient_predivide_factor`` f divides before the sum and multiplies by f / size after.

The ranks agree once, when the optimizer is built, that they wrap the same model (bucket
layout), else every rank raises. A reduction then needs no exchange of its own: the first
bucket carries one "active" slot per rank (1 from an active rank, 0 from a rank inside
``hvd.join()``, which keeps an answer of zeros posted on this optimizer's own communicators), so
the gradients travel with the news of who joined, at no extra round trip. Once a reduction
shows a joined rank, the following ones agree first (one small exchange on the Horovod world, as
every hvd collective) until the join completes, so a joined rank learns what to answer. Where a
joined rank cannot keep an answer posted (hierarchical buckets, whose first stage is within the
node, or ``check_collectives``), every reduction agrees first. ``agree=False`` (fleetlike's
keyword) does neither; then ``hvd.join()`` must not run while other ranks still step.

The wrapper is a real ``torch.optim.Optimizer`` (fleetlike's `fleet.DistributedOptimizer` with
Horovod's step), sharing ``param_groups`` and ``state`` with the wrapped optimizer, so LR
schedulers and ``GradScaler`` act on it. Ranks that called ``hvd.join()`` answer its gradient
reductions with zeros.

Example:
    >>> opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size()),
    ...                                named_parameters=model.named_parameters())
    >>> loss.backward(); opt.synchronize(); clip_grad_norm_(model.parameters(), 1.0)
    >>> with opt.skip_synchronize(): opt.step()
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import zlib
from collections.abc import Iterator
from typing import Any

import torch

from fleetlike.collectives import (
    Accumulation,
    Bucket,
    CompressedAllReduce,
    DownsampledAllReduce,
    FlatAllReduce,
    GradReducer,
    ScaledAllReduce,
    make_reducer,
    plan_buckets,
)
from fleetlike.collectives.divergence import DivergenceGuard
from fleetlike.comm import Work
from fleetlike.config import rules
from fleetlike.fleet import DistributedOptimizer as FleetDistributedOptimizer
from fleetlike.fleet import fleet
from fleetlike.horovod.grouping import plan_groups
from fleetlike.horovod.negotiate import ACTIVE, JOINED, Kind, check, descriptor
from fleetlike.horovod.ops import OP_NAMES, OPS, Compression, Compressor, ReduceOp
from fleetlike.horovod.order import agree_in_order
from fleetlike.horovod.runtime import Runtime, runtime
from fleetlike.horovod.strategy_units import StepTimer, passes_per_step
from fleetlike.roles.settings import every_from_env
from fleetlike.strategies.data_parallel import gradient_collective
from fleetlike.strategies.step import AppliedEntry
from fleetlike.strategies.topology import two_level_possible
from fleetlike.horovod import env as hvd_env
from fleetlike.horovod import timeline
from fleetlike.tune import REFORMED, OnlineTuner, Setting, agreed_after_reform, log_path, requested

__all__ = ["HorovodOptimizer", "OutsideSetOptimizer", "named_parameter_map"]

_ZERO_GRAD_ERROR = ("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                    "optimizer.synchronize(). This is prohibited as it can cause a race condition.")
_TOO_MANY = ("Gradients were computed more than backward_passes_per_step times before call to step(). "
             "Increase backward_passes_per_step to accumulate gradients locally.")
_STEP_AFTER_SYNC = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                    "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.")


def named_parameter_map(optimizer: torch.optim.Optimizer, named_parameters: Any) -> dict[int, str]:
    """Parameter id -> name, with Horovod's checks (tuples, unique names, every parameter named)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if named_parameters is None:  # Horovod's names: the group's index, then the parameter's
        return {id(p): f"allreduce.noname.{i}.{j}" for i, g in enumerate(optimizer.param_groups)
                for j, p in enumerate(g["params"])}
    named = list(named_parameters)
    if any(not isinstance(p, tuple) for p in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced "
                         "by model.named_parameters().")
    names = [k for k, _ in named]
    dups = sorted({k for k in names if names.count(k) > 1})
    if dups:
        raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(dups)}")
    given = {id(v) for _, v in named}
    unnamed = [id(p) for p in params if id(p) not in given]
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters were not named. "
                         f"Python object ids: {', '.join(map(str, unnamed))}")
    return {id(v): k for k, v in named}


def _single_stage(collective: Any) -> bool:
    """Whether a bucket's handle completes only once every rank has posted it (one allreduce
    per bucket, maybe scaled or compressed around it): what a joined rank's posted answer needs."""
    while isinstance(collective, (ScaledAllReduce, CompressedAllReduce)):
        collective = collective.inner
    return isinstance(collective, FlatAllReduce)


def _wire(compression: Any) -> str | None:
    if compression is Compression.none or compression is None:
        return None
    if compression is Compression.fp16:
        return "float16"
    if compression is Compression.bf16:
        return "bfloat16"
    raise TypeError(
        f"hvd.DistributedOptimizer(compression={compression!r}): the overlapped gradient buckets travel "
        "compressed through fleetlike's 16-bit codec, which takes hvd.Compression.none, .fp16 or .bf16; "
        "a custom Compressor works with hvd.allreduce(..., compression=...)"
    )


#: the strategy switches this face applies (to its gradient buckets); any other one raises
class HorovodWrapper(FleetDistributedOptimizer):
    """What Horovod's two optimizer wrappers (bucketed averaging, Adasum deltas) share: the eager
    style only, a plain backward and the wrapped optimizer's own state."""

    _names: dict[int, str]

    @property
    def _parameter_names(self) -> dict[torch.Tensor, str]:
        """Horovod's map of parameter -> name (``allreduce.noname.<group>.<index>`` unnamed)."""
        return {p: self._names[id(p)] for g in self.param_groups for p in g["params"]}

    def backward(self, loss: torch.Tensor) -> None:  # type: ignore[override]
        """``loss.backward()`` (Horovod has no loss scaling of its own)."""
        loss.backward()

    def minimize(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        raise TypeError("hvd.DistributedOptimizer is the eager-style Horovod wrapper; for fleet's program style "
                        "use fleet.distributed_optimizer(optimizer).minimize(loss_fn, model)")

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return self.inner_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        self.inner_optimizer.load_state_dict(state_dict)


class HorovodOptimizer(HorovodWrapper):
    """What ``hvd.DistributedOptimizer`` returns for Average and Sum (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters: Any = None,
                 compression: type[Compressor] | Compressor = Compression.none, backward_passes_per_step: int = 1,
                 op: ReduceOp = ReduceOp.AVERAGE, gradient_predivide_factor: float = 1.0, groups: Any = None,
                 sparse_as_dense: bool = False, *, strategy: Any = None, agree: bool = True,
                 rt: Runtime | None = None) -> None:
        rt = rt or runtime("hvd.DistributedOptimizer")
        if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
            raise ValueError(f"hvd.DistributedOptimizer reduces gradients with Average, Sum or Adasum; got op={op.value!r}")
        if gradient_predivide_factor != 1.0 and op is not ReduceOp.AVERAGE:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        chosen = fleet.effective_strategy(strategy or rt.strategy, "hvd.DistributedOptimizer").copy()
        henv = hvd_env.read()  # Horovod's launch-line variables win over the strategy, as FLEETLIKE_STRATEGY
        chosen = henv.apply(chosen)
        tuned = requested(chosen)
        if tuned is not None:
            chosen = tuned
        # a switch this face cannot apply (local SGD, sharding, AMP, ...) raises, never dropped
        rules.refuse_unhonoured(chosen, "horovod")
        if chosen.gossip and chosen.auto_tune:
            raise ValueError("strategy.gossip with auto_tune on hvd.DistributedOptimizer: the tuner lays the "
                             "buckets out anew, and gossip's residuals belong to the old buckets. Fix: turn one "
                             "of them off (FLEETLIKE_DOWNSAMPLE_N_ELEMENTS=1 or FLEETLIKE_AUTOTUNE=0)")
        # AIACC's accumulate knob (gradient_merge) is Horovod's backward_passes_per_step here
        backward_passes_per_step = passes_per_step(chosen, backward_passes_per_step)
        wire = _wire(compression)
        if wire is not None:
            chosen.fp16_allreduce = True
            chosen.fp16_allreduce_configs = {"dtype": wire}
        super().__init__(optimizer, chosen, fleet.context())
        self._names = named_parameter_map(optimizer, named_parameters)
        self.op = op
        #: agree with the other ranks before each reduction (join, model mismatch check)
        self.agree = bool(agree)
        self.compression = compression
        self.sparse_as_dense = bool(sparse_as_dense)
        self.gradient_predivide_factor = gradient_predivide_factor
        #: Horovod's backward_passes_per_step: the k-th backward reduces, step() closes the window
        self._accumulation = Accumulation(backward_passes_per_step, field="backward_passes_per_step",
                                          too_many=_TOO_MANY)
        self._params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        self._groups_arg = groups
        #: Horovod's explicit grouping: each group one bucket (see `fleetlike.horovod.grouping`)
        self._planned_groups = None if groups is None else plan_groups(groups, self._params, self._names)
        self._hvd_lock = threading.RLock()
        #: parameters whose gradients are sparse (learnt by the reducer): handed back sparse
        self._sparse: set[int] = set()
        self.reducer: GradReducer | None = None  # type: ignore[assignment]
        self._bind(rt)
        #: the online tuner (strategy.auto_tune, HOROVOD_AUTOTUNE=1, FLEETLIKE_AUTOTUNE=1), ticked by step()
        self.tuner: OnlineTuner | None = None
        self._env_notes = [("horovod_env", True, f"{k}={v}") for k, v in henv.seen]
        self._henv, self._tuned = henv, chosen
        if chosen.auto_tune:
            self.tuner = self._new_tuner(rt)

    def _new_tuner(self, rt: Runtime) -> OnlineTuner:
        groups = rt.optimizer_groups()
        agree = groups.extra("hvd autotune", 0, rt.comm.rank)
        assert agree is not None  # every rank takes part
        ok, _ = two_level_possible(self._tuned, groups, rt.role)
        fixed = self._henv.fixed_by
        if self._groups_arg is not None:
            fixed = {**fixed, "bucket_mb": "one bucket per group of the groups argument"}
        return OnlineTuner(agree, self._tuned, param_bytes=[p.numel() * p.element_size() for p in self._params],
                           two_level_ok=ok and self._groups_arg is None, apply=self._retune, fixed=fixed,
                           log_path=self._henv.autotune_log or log_path())

    def _retune(self, setting: Setting) -> None:
        """The tuner's switch, between steps on every rank: the buckets and communicators are
        built anew for ``setting`` (the gradients are kept), as for a re-formed world."""
        with self._hvd_lock:
            self.user_defined_strategy = setting.applied_to(self.user_defined_strategy)
            self._rebuild(self._rt)

    def _follow_tuner(self, rt: Runtime) -> Setting | None:
        """The world re-formed (before the buckets are built on it): None where no rank had begun
        tuning (tune afresh), else the setting every rank now runs, the one the running ranks
        agreed on (`fleetlike.tune.reform`), written into the strategy so the buckets follow it."""
        assert self.tuner is not None
        agree = rt.optimizer_groups().extra("hvd autotune", 0, rt.comm.rank)
        assert agree is not None
        kept = agreed_after_reform(self.tuner, agree)
        if kept is not None:
            self.user_defined_strategy = kept.applied_to(self.user_defined_strategy)
        return kept

    def applied_strategy(self) -> list[AppliedEntry]:
        """What this optimizer applies (the Horovod face's ``fleet.applied_strategy()``): its
        buckets, the strategy's notes, the Horovod variables that acted and the tuner's choice."""
        s = self.user_defined_strategy
        rows = [AppliedEntry("data_parallel", True, f"{len(self.reducer.buckets)} buckets "
                             + (f"of <= {s.fuse_grad_size_in_MB:g} MB" if s.fuse_all_reduce_ops else "(one per gradient)")
                             + f" over {s.nccl_comm_num} communicator(s)")]
        rows += [AppliedEntry(*n) for n in [*self.notes, *self._env_notes]]
        if s.gradient_merge:
            rows.append(AppliedEntry("gradient_merge", True, f"the sum of {self.backward_passes_per_step} backward "
                                     "passes per reduction (Horovod's backward_passes_per_step)"))
        if self._timer is not None:
            rows.append(AppliedEntry("slow_rank_check", True, self._timer.describe()))
        if self.tuner is not None:
            rows.append(AppliedEntry("auto_tune", True, self.tuner.summary()))
        return rows

    def _bind(self, rt: Runtime) -> None:
        """Build the buckets, their communicators and hooks on ``rt`` (collective: every rank
        binds its optimizers in the same order). Called at construction and again when an
        elastic job re-forms the world (`rebind`)."""
        self._rt: Runtime = rt
        chosen = self.user_defined_strategy
        params = self._params
        cap = chosen.bucket_cap_bytes(params)
        self._join_id = next(i for i in range(len(rt.optimizers) + 1) if i not in rt.optimizers)
        # the buckets travel on communicators of their own, so an agreement on the Horovod world
        # overlaps them (each communicator keeps its own order); with join answered from the
        # bucket flags, on communicators of this optimizer's own (see `fleetlike.horovod.join`)
        own = self.agree and not chosen.use_hierarchical_allreduce and not rt.comm.check_collectives
        rings = rt.optimizer_rings(self._join_id, chosen.nccl_comm_num) if own else None
        collective, self.notes = gradient_collective(chosen, rt.optimizer_groups(), rt.role, rings=rings)
        old_gossip = getattr(self, "_gossip", None)
        #: gossip's collective (strategy.gossip, FLEETLIKE_/PERSEUS_DOWNSAMPLE_N_ELEMENTS), its residuals
        self._gossip = collective if isinstance(collective, DownsampledAllReduce) else None
        n = rt.comm.size
        #: no agreement per reduction: the first bucket carries the ranks' active flags
        self._flagged = own and _single_stage(collective)
        #: a reduction of this join epoch showed a joined rank: agree before each reduction
        self._joiners = False
        #: inside hvd.join: the posted first bucket of zeros, then every bucket's handle
        self._join_first: Work | None = None
        self._join_rest: list[Work] | None = None
        pre = 1.0 / self.gradient_predivide_factor
        post = self.gradient_predivide_factor * (n if self.op is ReduceOp.SUM else 1)
        if pre != 1.0 or post != 1.0:
            collective = ScaledAllReduce(collective, pre, post)
        if timeline.recording():  # each bucket's allreduce on the trace (HOROVOD_TIMELINE)
            collective = timeline.TimedCollective(collective)
        self._accumulation.close()
        self._communicated = False
        self._synchronized = False
        self._should_synchronize = True
        planned = plan_buckets(params, cap) if self._groups_arg is None else self._planned_groups
        buckets = [Bucket(i, ps) for i, ps in enumerate(planned)]
        self._slots = buckets[0].numel if buckets and self._flagged else -1
        if self._slots >= 0:  # one active slot per rank after the first bucket's gradients
            buckets[0] = Bucket(0, buckets[0].params, (buckets[0].offsets, self._slots + n))
        # the reducer's hook is the only one: it asks this optimizer (its gate) at the first
        # gradient of each backward whether it reduces, and learns which gradients are sparse
        self.reducer = make_reducer(params, collective, cap_bytes=cap, names=self._names, buckets=buckets,
                                    gate=self, sparse=True, lock=self._hvd_lock,
                                    check_nan_inf=bool(chosen.check_nan_inf))
        self.reducer.sparse = self._sparse  # kept across a rebind
        self._flag_view: torch.Tensor | None = None
        if self._gossip is not None and old_gossip is not None and old_gossip.sampler.n == self._gossip.sampler.n:
            self._gossip.sampler = old_gossip.sampler  # a re-formed world keeps the buckets and their residuals
        #: the slow-rank check (strategy.slow_rank_check, FLEETLIKE_/PERSEUS_PERF_CHECK_N_STEPS)
        self._timer = (StepTimer(chosen, rt.role, rt.optimizer_groups().extra("hvd slow-rank check", 0, rt.comm.rank))
                       if chosen.slow_rank_check else None)
        self._one_hot: torch.Tensor | None = None
        self._views = {id(p): (b, b.views[j]) for b in self.reducer.buckets for j, p in enumerate(b.params)}
        self._numel = sum(p.numel() for p in params)
        sizes = [b.numel for b in self.reducer.buckets]
        self._layout = (len(sizes), zlib.crc32(repr((sizes, self._flagged)).encode()) & 0x7FFFFFFF)
        self._agree(Kind.OPTIMIZER_SETUP)  # once: every rank wraps the same model (bucket layout)
        rt.optimizers[self._join_id] = self
        self._need_agreement = False
        guard_comm = rt.optimizer_groups().extra("hvd divergence guard", 0, rt.comm.rank)
        assert guard_comm is not None
        self._guard = DivergenceGuard(guard_comm, [(self._names.get(id(p), f"parameter {i}"), p) for i, p in enumerate(params)],
                                      every=every_from_env(), what="hvd.DistributedOptimizer")

    def rebind(self, rt: Runtime) -> None:
        """Follow a re-formed world (an elastic job): the gradients in the buckets are kept, the
        communicators, buckets and hooks are built anew on ``rt``; the tuner follows
        (`_follow_tuner`)."""
        with self._hvd_lock:
            kept = self._follow_tuner(rt) if self.tuner is not None else None
            self._rebuild(rt)  # every rank with the same setting: the agreed one, or its own untouched start
            if self.tuner is not None and kept is None:
                self.tuner = self._new_tuner(rt)
            elif self.tuner is not None and kept is not None and (not self.tuner.done or self.tuner.current != kept):
                self.tuner.stop(kept, REFORMED)

    def _rebuild(self, rt: Runtime) -> None:
        with self._hvd_lock:
            grads = {id(p): p.grad.detach().clone() for p in self._params if p.grad is not None}
            self._detach()
            for p in self._params:
                p.grad = grads.get(id(p))
            self._bind(rt)

    def __repr__(self) -> str:
        return f"hvd.DistributedOptimizer({self.inner_optimizer!r})"

    @property
    def backward_passes_per_step(self) -> int:
        return self._accumulation.k

    @backward_passes_per_step.setter
    def backward_passes_per_step(self, passes: int) -> None:
        self._accumulation.set_k(passes, "backward_passes_per_step")

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Horovod's setter: communicate every ``passes`` backward passes."""
        self.backward_passes_per_step = passes

    @property
    def slow_rank_report(self) -> Any:
        """The slow-rank check's last `fleetlike.strategies.health.SlowRankReport` (every rank's
        mean step time and data wait, the slow ranks); None before its first window closes or
        without ``slow_rank_check`` (``FLEETLIKE_PERF_CHECK_N_STEPS`` / ``PERSEUS_PERF_CHECK_N_STEPS``)."""
        return self._timer.report if self._timer is not None else None

    # ------------------------------------------------------------------ the reducer's gate

    def begin_pass(self) -> bool:
        """The first gradient of a backward (under the reducer's lock, ours): count the pass;
        the k-th reduces, its buckets starting as they fill (an agreement runs at its end)."""
        if not self._accumulation.begin():
            return False
        self._mark_active()
        self._need_agreement = self._agrees()
        self._communicated = True
        return True

    def before_wait(self) -> None:
        if self._need_agreement:  # while the buckets are in flight on their communicators
            self._need_agreement = False
            self._agree()

    def after_wait(self) -> None:
        self._read_flags()  # who took part, before anything else reads the mode

    def _agrees(self) -> bool:
        """Whether the next reduction exchanges first (see the module docstring)."""
        return self.agree and (not self._flagged or self._joiners)

    def _agree(self, kind: Kind = Kind.OPTIMIZER) -> None:
        """The ranks agree on this reduction (model, op) and joined ranks learn of it."""
        rt = self._rt
        row = descriptor(kind, op=OPS.index(self.op), root=self._join_id, numel=self._numel, shape=self._layout,
                       name=f"DistributedOptimizer.{self._join_id}")
        with rt.lock:
            ag = agree_in_order(rt, row, "hvd.DistributedOptimizer")
            check(ag, rt.comm, "hvd.DistributedOptimizer", OP_NAMES)

    def _flags(self) -> torch.Tensor:
        if self._flag_view is None:  # the buffer is fixed: slice it once (twice per step otherwise)
            self._flag_view = self.reducer.buckets[0].buffer[self._slots : self._slots + self._rt.comm.size]
        return self._flag_view

    def _mark_active(self) -> None:
        """This rank's slot 1, the others' 0, before the first bucket starts."""
        if self._slots >= 0:
            flags = self._flags()
            if self._one_hot is None:
                self._one_hot = torch.zeros_like(flags)
                self._one_hot[self._rt.comm.rank] = 1
            flags.copy_(self._one_hot)  # one op per step

    def _read_flags(self) -> None:
        """After a reduction: a slot still 0 is a rank inside ``hvd.join()`` (every rank reads the
        same sums, so every rank switches to agreeing at the same reduction)."""
        if self._slots >= 0:
            states = [ACTIVE if v > 0 else JOINED for v in self._flags().tolist()]
            if JOINED in states:
                self._joiners = True
                self._rt.note_states(states)

    @property
    def answers_from_flags(self) -> bool:
        """A joined rank posts its answer to this optimizer's next reduction ahead (no agreement)."""
        return self._flagged and not self._joiners

    def end_join(self) -> None:
        """Every rank has joined: reductions go back to running without agreement (and the
        tuner, which no rank ticked during the join, restarts its clock)."""
        self._joiners = False
        if self.tuner is not None:
            self.tuner.pause()

    def _reduce_now(self) -> None:
        """Reduce the current gradients outside a backward (Horovod's "missing" parameters)."""
        self.reducer.fold()
        if self._agrees():
            self._agree()
        self._mark_active()
        self.reducer.prepare()
        self.reducer.finalize()
        self._read_flags()

    def _zero_for_join(self) -> None:
        for b in self.reducer.buckets:
            b.zero_()  # the active slots too: this rank has joined
        for p in self._params:
            p.grad = self._views[id(p)][1]

    def _answer_join(self) -> None:
        """A joined rank's part in the other ranks' agreed gradient reduction: zeros."""
        with self._hvd_lock:
            if self._join_rest is not None:  # the reduction that showed the join came first
                self._settle_join()
            self._zero_for_join()
            self.reducer.prepare()
            self.reducer.finalize()
            self._read_flags()

    def post_join_answer(self) -> None:
        """Post a joined rank's first bucket of zeros ahead of the active ranks' next reduction
        (it completes when they start theirs); `join_progress` / `settle_join` do the rest."""
        with self._hvd_lock:
            self._zero_for_join()
            self._join_first = self.reducer.collective.start(self.reducer.buckets[0])

    @property
    def join_pending(self) -> bool:
        return self._join_first is not None or self._join_rest is not None

    def join_progress(self) -> bool:
        """Never blocks: once the first bucket completes post the others (in the active ranks'
        order), once they complete read who took part. True if anything moved."""
        with self._hvd_lock:
            if self._join_first is not None and self._join_first.is_completed():
                self._post_join_rest()
                return True
            if self._join_rest is not None and all(w.is_completed() for w in self._join_rest):
                self._settle_join()
                return True
            return False

    def _post_join_rest(self) -> None:
        assert self._join_first is not None
        first, self._join_first = self._join_first, None
        self._join_rest = [first] + [self.reducer.collective.start(b) for b in self.reducer.buckets[1:]]

    def settle_join(self) -> None:
        """Finish the posted answer (blocking: the other ranks have posted theirs)."""
        with self._hvd_lock:
            if self._join_first is not None:
                self._post_join_rest()
            if self._join_rest is not None:
                self._settle_join()

    def _settle_join(self) -> None:
        works, self._join_rest = self._join_rest or [], None
        for w in works:
            w.wait()
        self._read_flags()

    def _detach(self) -> None:
        if self.reducer is not None:
            self.reducer.remove()
        if self._rt.optimizers.get(self._join_id) is self:
            del self._rt.optimizers[self._join_id]

    # ------------------------------------------------------------------ Horovod's optimizer API

    def synchronize(self) -> bool:  # type: ignore[override]
        """Finish reducing the gradients (reducing them now if no backward did)."""
        with self._hvd_lock:
            if self._timer is not None:
                self._timer.sync_begins(self.reducer.wait_seconds)
            if self._communicated:
                self.reducer.finalize()  # already waited at the end of the backward: a no-op
            else:
                self._reduce_now()
            self._accumulation.close()
            self._communicated = False
            self._synchronized = True
            self.reducer.restore_sparse()  # a sparse-gradient optimizer (SparseAdam) needs them so
        return True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside, ``step()`` uses the gradients as they are (call ``synchronize()`` first)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Synchronize (unless inside ``skip_synchronize``), then the wrapped optimizer's step."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(_STEP_AFTER_SYNC, stacklevel=2)
            self.synchronize()
        self._synchronized = False
        result = self.inner_optimizer.step(closure)
        if not (self._joiners or self._rt.joined_seen):  # a joined rank no longer steps: no check
            self._guard.tick()
            if self._timer is not None:
                self._timer.step_done(self.reducer.wait_seconds)
            if self.tuner is not None and not self.tuner.done:
                self.tuner.step_done()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (in place: they are bucket views); refused while a backward's
        reductions are not consumed by ``step()`` / ``synchronize()``, as Horovod."""
        if self._accumulation.count:
            raise AssertionError(_ZERO_GRAD_ERROR)
        self.reducer.zero_grad()
        for g in self.param_groups:
            for p in g["params"]:
                if id(p) not in self._views and p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.detach_().zero_()



class OutsideSetOptimizer(HorovodWrapper):
    """``hvd.DistributedOptimizer(..., process_set=S)`` on a rank outside ``S``: as in Horovod,
    no gradient is reduced (no hooks) and ``step()`` is the wrapped optimizer's own."""

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters: Any, process_set: Any) -> None:
        super().__init__(optimizer, fleet.context().strategy, fleet.context())
        self._names = named_parameter_map(optimizer, named_parameters)
        self.process_set = process_set
        self.backward_passes_per_step = 1
        self._should_synchronize = True

    def __repr__(self) -> str:
        return f"hvd.DistributedOptimizer({self.inner_optimizer!r}, outside {self.process_set})"

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes

    def synchronize(self) -> bool:  # type: ignore[override]
        return True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        yield

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        return self.inner_optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner_optimizer.zero_grad(set_to_none)

    def _detach(self) -> None:
        pass

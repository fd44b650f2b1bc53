"""Trace one strategy: the real program of every rank, built in one process, run dry on rank 0.

`trace` builds the engine and ``fleet.main_program`` for each rank of the planned cluster (one
thread per rank, `fleetlike.plan.dry` communicators), then runs rank 0's ``main_program`` op
by op for a warm-up and one full period of the strategy's schedule (lcm of gradient merge's and
local SGD's k), tagging every collective with the step, the op that issued it and, for gradient
buckets, the bucket. It also times each op (the compute the step costs on this machine, with
the strategy's recompute and AMP in force) and when each bucket became ready in backward, and
counts the tensors each rank keeps (`fleetlike.plan.memory`).

**Fresh gradient pages.** A program without gradient buckets (local SGD replaces data parallel;
its ``clear_grad`` is ``zero_grad(set_to_none=True)``) frees every gradient at the end of the
step and the next backward allocates them again. In a rank's own process those blocks sit at
the top of the heap and glibc hands them back to the OS when they are freed together, so each
backward first-touches (page-faults and zeroes) all of them again: 8,164 minor faults per step
on the 50 MB MLP's ranks, ~11 ms of a 33 ms forward/backward alone. This process, which has
built every rank and earlier traces, keeps free memory that the gradients reuse resident (0
faults), so the op times alone miss that cost. `StepTrace.refault` adds it back: the pages of
the gradients backward allocated fresh, at the first-touch cost per page measured here
(`first_touch_seconds`). An upper bound: glibc keeps freed blocks below its trim threshold
resident (the 14 MB transformer's gradients refault ~10% of their pages on its ranks).

**A clock without this process's faults.** Every time the trace takes (op times, bucket ready
times and work, call times) is on `DryFabric.now` with the minor faults of the traced thread's
work (its own and its intra-op helpers', not another thread's: `fleetlike.plan.faults`) taken
off at that per-page cost. This process's heap faults at random: the MLP's backward, with
its gradients in buckets, took 0, 4k, 8k or 12k faults from one step to the next and 39, 55,
61 or 72 ms; the ranks' steady state took none (counted with getrusage). Left in, it was part of what moved
one strategy's prediction by 10-15% between two traces. The pages a rank does fault are the
fresh gradients above, priced by ``refault``.

Example:
    >>> t = trace(ModelSpec(build, batch_size=16), DistributedStrategy(), Cluster(2, 2))
    >>> t.steps[0].buckets[0].events[0].op
    'all_reduce'
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import mmap
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from fleetlike.comm import CommGroups, CompletedWork
from fleetlike.config import DistributedStrategy
from fleetlike.plan.dry import DryCommunicator, DryFabric, Event
from fleetlike.plan.memory import MemoryBreakdown, activation_bytes, measure_state
from fleetlike.plan.spec import Cluster, ModelSpec, model_work
from fleetlike.program import Program, StepState
from fleetlike.roles.role import Role
from fleetlike.strategies.engine import Engine, build_engine
from fleetlike.strategies.programs import build_programs
from fleetlike.strategies.sharding import ShardingUnit, whole_update_reason
from fleetlike.strategies.step import StepContext

__all__ = ["BucketTrace", "GatherTrace", "StepTrace", "Trace", "first_touch_seconds", "period_of", "trace"]


@dataclasses.dataclass
class BucketTrace:
    """One gradient bucket in one step: when it was ready (seconds after backward began), the
    collectives it issued and ``work``: the seconds of local work (in this process, alone)
    before each of its calls and, last, after them: the copies, the 16-bit codec's scan, casts
    and division, the two-level chain's sums. The ranks' bucket worker does that work between
    its calls, so it lies on the bucket's path (`fleetlike.plan.cost`); the trace's calls take
    no time, so the gaps between them are exactly that work."""

    index: int
    ready: float
    events: list[Event]
    work: tuple[float, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.events)


@dataclasses.dataclass
class GatherTrace:
    """Sharding's parameter gather as the program issues it (`ParamGather.layout`).

    ``op``: the op whose blocking calls are the gather's broadcasts (``optimizer_update`` when
    the update is interleaved with them, else ``c_allgather_params``); ``window``: bytes of
    buckets in flight before a rank waits for the oldest; ``buckets``: per bucket its bytes and
    its chunks ``(owner, [broadcast bytes])`` in issue order; ``gaps``: seconds rank 0 spent
    before each broadcast since the previous one (or the op's start) in the traced run, and
    ``tail`` after the last, both without its optimizer steps (the buckets' zeroing, the
    copies out of the packed buffers); ``steps``: seconds rank 0 spent in optimizer steps
    before each broadcast (its own chunks' updates, measured around ``optimizer.step``)."""

    op: str
    interleaved: bool
    window: int
    buckets: list[tuple[int, list[tuple[int, list[int]]]]]
    gaps: list[float]
    tail: float
    steps: list[float]


@dataclasses.dataclass
class StepTrace:
    """One step of the period: op times (seconds), buckets, other collectives by op.

    ``fresh_bytes``: gradient bytes backward allocated for parameters whose gradient the
    previous step had freed; ``refault``: seconds a rank's process spends first-touching those
    pages (the op times here hold no page faults; see the module docstring)."""

    times: dict[str, float]
    buckets: list[BucketTrace]
    blocking: list[tuple[str, list[Event]]]
    gather: GatherTrace | None = None
    fresh_bytes: int = 0
    refault: float = 0.0

    @property
    def events(self) -> list[Event]:
        return [e for b in self.buckets for e in b.events] + [e for _, es in self.blocking for e in es]


@dataclasses.dataclass
class Trace:
    """Everything the cost model needs about one strategy on one cluster."""

    strategy: DistributedStrategy
    cluster: Cluster
    steps: list[StepTrace]
    listing: str
    memory: MemoryBreakdown
    program: Program
    describe: list[dict[str, Any]]
    #: ``spec.compute_seconds`` (an AMP strategy's: ``amp_compute_seconds`` where given) over
    #: the same work timed here alongside the traced periods (median), or None without it
    #: (`fleetlike.plan.spec`)
    compute_scale: float | None = None

    @property
    def period(self) -> int:
        return len(self.steps)

    def events(self) -> list[Event]:
        """Every collective of one period, in issue order."""
        return [e for s in self.steps for e in s.events]


def period_of(s: DistributedStrategy) -> tuple[int, int]:
    """``(warm-up steps, period)``: local SGD averages every step up to begin_step, then every
    k; gradient merge communicates every k-th step. The steady state repeats every lcm."""
    k = int(s.gradient_merge_configs["k_steps"]) if s.gradient_merge else 1
    warm = 2
    if s.localsgd:
        ls = int(s.localsgd_configs["k_steps"])
        k = math.lcm(k, ls)
        warm = max(warm, int(s.localsgd_configs["begin_step"]) + 1)
    return warm, k


@functools.lru_cache(maxsize=1)
def first_touch_seconds(nbytes: int = 16 << 20) -> float:
    """Seconds per page that writing freshly mapped memory costs over writing resident memory:
    the minor fault and the kernel's zeroing that a rank pays for every page its allocator got
    back from the OS (the fastest of five 16 MiB maps against the fastest of five rewrites: a
    busy machine's preemption only ever adds time, and a median of differences read 0 there;
    measured once per process, like the op times on this machine and scaled with them)."""
    pages = nbytes // mmap.PAGESIZE
    touch, resident = [], []
    for _ in range(5):
        m = mmap.mmap(-1, nbytes)
        try:
            buf = torch.frombuffer(m, dtype=torch.uint8)
            t0 = time.perf_counter()
            buf.fill_(1)  # every page faulted in, zeroed, then written
            t1 = time.perf_counter()
            buf.fill_(2)  # the same writes to resident pages
            t2 = time.perf_counter()
            del buf
        finally:
            m.close()
        touch.append(t1 - t0)
        resident.append(t2 - t1)
    return max(0.0, min(touch) - min(resident)) / pages


class _Tagged:
    """Wraps the reducer's bucket collective: tags each bucket's calls and runs them to completion
    at once (dry calls take no time, so waiting keeps the tags exact)."""

    def __init__(self, inner: Any, fabric: DryFabric, clock: Callable[[], float]) -> None:
        self.inner = inner
        self.fabric = fabric
        self.clock = clock
        self.ready: dict[int, float] = {}
        #: each bucket's (start, end) on the fabric's clock, the clock of its events' ``at``
        self.spans: dict[int, tuple[float, float]] = {}
        self.step = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def world(self) -> Any:
        return self.inner.world

    def describe(self, bucket: Any) -> dict[str, Any]:
        return self.inner.describe(bucket)

    def start(self, bucket: Any) -> CompletedWork:
        self.ready[bucket.index] = self.clock()
        prev = self.fabric.tag
        self.fabric.tag = (self.step, "bucket", bucket.index)
        start = self.fabric.now()
        try:
            self.inner.start(bucket).wait()
        finally:
            self.fabric.tag = prev
            self.spans[bucket.index] = (start, self.fabric.now())
        return CompletedWork(None)


def _work(events: list[Event], span: tuple[float, float]) -> tuple[float, ...]:
    """The local work before each of a bucket's calls and after the last (`BucketTrace.work`)."""
    marks = [span[0], *(e.at for e in events), span[1]]
    return tuple(max(0.0, b - a) for a, b in zip(marks, marks[1:]))


def _roles(cluster: Cluster) -> list[Role]:
    eps = [f"10.0.{n}.1:{6000 + r}" for n in range(cluster.nodes) for r in range(cluster.per_node)]
    return [Role.from_endpoints(r, eps, job_id="plan") for r in range(len(eps))]


def _build(spec: ModelSpec, strategy: DistributedStrategy, role: Role, fabric: DryFabric
           ) -> tuple[Engine, Program, Program, Any]:
    torch.manual_seed(0)
    model, loss_fn, feed = spec.build()
    opt = spec.optimizer(model)
    world = DryCommunicator(fabric, role.rank, role.world_size, range(role.world_size), "world")
    groups = CommGroups(world, role)
    ctx = StepContext(model=model, strategy=strategy, groups=groups, role=role,
                      device=torch.device("cpu"), optimizer=opt)
    engine = build_engine(ctx)
    for unit in engine.units:
        unit.bind(opt)
    origin, main, startup = build_programs(engine, loss_fn)
    return engine, main, startup, feed


def trace(spec: ModelSpec, strategy: DistributedStrategy, cluster: Cluster, *, repeats: int = 5) -> Trace:
    """Build ``strategy``'s programs for every rank of ``cluster`` and run rank 0's dry.

    ``repeats`` periods are run after the warm-up; op times are the median over them (five by
    default: two periods disturbed by the machine cannot move a median of five; three let one
    strategy's prediction move by 10% between traces here)."""
    n = cluster.world_size
    fabric = DryFabric(n)
    built: dict[int, Any] = {}
    errors: list[BaseException] = []
    roles = _roles(cluster)

    def build_rank(r: int) -> None:
        try:
            built[r] = _build(spec, strategy, roles[r], fabric)
        except BaseException as exc:  # noqa: BLE001 - reported below with the rank
            errors.append(exc)
            fabric.timeout = 0.1  # the others stop waiting for this rank's splits

    threads = [threading.Thread(target=build_rank, args=(r,), name=f"plan-rank{r}") for r in range(1, n)]
    for t in threads:
        t.start()
    build_rank(0)
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    engine, main, startup, feed = built[0]
    fabric.live = False  # from here on rank 0 runs alone: collectives complete with local data
    fabric.timeout = 5.0  # a split now would wait for ranks that no longer run: fail fast
    for r in range(1, n):  # the other ranks' models were needed for the build only
        built.pop(r)
    startup.run()
    warm, period = period_of(strategy)
    reducer = engine.ctx.reducer
    t_bwd = [0.0]
    tagged = None
    if reducer is not None:
        tagged = _Tagged(reducer.collective, fabric, lambda: fabric.now() - t_bwd[0])
        reducer.collective = tagged
    recorded: list[list[StepTrace]] = []
    act: tuple[int, int] = (0, 0)
    gather = _gather_of(engine)
    stepped: list[tuple[float, float]] = []  # rank 0's optimizer steps on the fabric's clock
    if gather is not None and gather[1]:
        opt = engine.ctx.optimizer
        inner_step = opt.step

        def timed_step(*args: Any, **kwargs: Any) -> Any:
            t = fabric.now()
            try:
                return inner_step(*args, **kwargs)
            finally:
                stepped.append((t, fabric.now()))

        opt.step = timed_step  # this process's own optimizer: the real ranks' are not touched
    # the op times are what the planner charges: no garbage collection of earlier traces'
    # objects inside them (what timeit does too; a full collection takes ~1 s once many are kept)
    params = [p for p in engine.ctx.model.parameters() if p.requires_grad]
    page_s = first_touch_seconds()
    fabric.fault_seconds = page_s  # every time below on a clock without this process's faults
    figure, amp = _compute_figure(spec, strategy)
    reference = _reference(spec, fabric, amp) if figure is not None else None
    ref_times: list[float] = []
    gc.collect()
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for i in range(warm + repeats * period):
            st = StepState(feed=feed)
            times: dict[str, float] = {}
            blocking: list[tuple[str, list[Event]]] = []
            spans: dict[str, tuple[float, float]] = {}
            stepped.clear()
            fresh = 0
            if tagged is not None:
                tagged.ready, tagged.spans, tagged.step = {}, {}, i
            for op in main.ops:
                if op.fn is None:
                    continue
                fabric.tag = (i, op.type)
                before = len(fabric.events)
                start = fabric.now()
                if op.type == "backward":
                    t_bwd[0] = start
                    unset = [p for p in params if p.grad is None]
                if op.type == "forward" and i == warm:
                    with activation_bytes(engine.ctx.model) as counted:
                        op.fn(st)
                    act = (counted.total, counted.half)
                else:
                    op.fn(st)
                times[op.type] = times.get(op.type, 0.0) + max(0.0, fabric.now() - start)
                if op.type == "backward":
                    fresh += sum(p.grad.numel() * p.grad.element_size() for p in unset if p.grad is not None)
                mine = [e for e in fabric.events[before:] if e.tag == (i, op.type)]
                if mine:
                    blocking.append((op.type, mine))
                    if gather is not None and op.type == gather[0]:
                        spans[op.type] = (start, fabric.now())
            if i < warm:
                fabric.events.clear()
                continue
            if reference is not None and (i - warm) % period == period - 1:
                ref_times.append(reference())
            buckets = []
            if tagged is not None:
                for b, ready in sorted(tagged.ready.items()):
                    events = [e for e in fabric.events if e.tag == (i, "bucket", b)]
                    buckets.append(BucketTrace(b, ready, events, _work(events, tagged.spans[b])))
            j = (i - warm) // period
            if j == len(recorded):
                recorded.append([])
            refault = -(-fresh // mmap.PAGESIZE) * page_s
            recorded[j].append(StepTrace(times, buckets, blocking, _gather_trace(gather, blocking, spans, stepped),
                                         fresh, refault))
            fabric.events.clear()
    finally:
        if gc_was:
            gc.enable()
    steps = _median_steps(recorded)
    memory = measure_state(engine, act, strategy)
    scale = None
    if figure is not None:
        scale = figure / max(statistics.median(ref_times), 1e-9)
    return Trace(strategy, cluster, steps, str(main), memory, main,
                 reducer.describe() if reducer is not None else [], scale)


def _compute_figure(spec: ModelSpec, strategy: DistributedStrategy) -> tuple[float | None, str | None]:
    """The job's compute figure this trace scales by and the autocast of its reference work:
    an AMP strategy's own (`ModelSpec.amp_compute_seconds`, its dtype) where the job gave one,
    else the float32 figure, else None."""
    if strategy.amp and spec.amp_compute_seconds is not None:
        return spec.amp_compute_seconds, str(strategy.amp_configs["dtype"])
    return spec.compute_seconds, None


def _reference(spec: ModelSpec, fabric: DryFabric, amp: str | None = None) -> Callable[[], float]:
    """`model_work` on the fabric's clock, run once untimed (it allocates the gradients)."""
    run = model_work(spec, fabric.now, amp=amp)
    run()
    return run


def _gather_of(engine: Engine) -> tuple[str, bool, Any] | None:
    """``(op type, interleaved, ParamGather)`` of a sharding engine, else None."""
    for unit in engine.units:
        if isinstance(unit, ShardingUnit):
            opt = engine.ctx.optimizer
            whole = (not unit.overlap or opt is None or whole_update_reason(opt) is not None)
            return ("c_allgather_params" if whole else "optimizer_update", not whole, unit.gather)
    return None


def _gather_trace(gather: tuple[str, bool, Any] | None, blocking: list[tuple[str, list[Event]]],
                  spans: dict[str, tuple[float, float]], stepped: list[tuple[float, float]]) -> GatherTrace | None:
    if gather is None:
        return None
    op, interleaved, pg = gather
    events = [e for name, es in blocking if name == op for e in es]
    layout = pg.layout()
    sizes = [n for _, chunks in layout for _, pieces in chunks for n in pieces]
    if op not in spans or [e.nbytes for e in events] != sizes:
        raise RuntimeError(f"planner: the traced gather ({len(events)} calls in {op}) does not match the "
                           f"sharding layout ({len(sizes)} broadcasts); the cost model would misprice it")
    start, end = spans[op]
    at = [start] + [e.at for e in events] + [end]

    def stepping(lo: float, hi: float) -> float:
        return sum(b - a for a, b in stepped if lo <= a and b <= hi)

    steps = [stepping(a, b) for a, b in zip(at, at[1:])]
    gaps = [max(0.0, b - a - st) for a, b, st in zip(at, at[1:], steps)]
    return GatherTrace(op, interleaved, pg.window_bytes, layout, gaps[:-1], gaps[-1], steps[:-1])


def _median_steps(recorded: list[list[StepTrace]]) -> list[StepTrace]:
    """Step j of the period with each time (and bucket ready time) the median over periods."""
    out = []
    for j, first in enumerate(recorded[0]):
        same = [rep[j] for rep in recorded]
        times = {k: statistics.median(s.times.get(k, 0.0) for s in same) for k in first.times}
        buckets = [BucketTrace(b.index, statistics.median(s.buckets[k].ready for s in same), b.events,
                               tuple(statistics.median(w) for w in zip(*(s.buckets[k].work for s in same))))
                   for k, b in enumerate(first.buckets)]
        gather = first.gather
        if gather is not None:
            gs = [s.gather for s in same if s.gather is not None]
            gather = dataclasses.replace(gather, gaps=[statistics.median(g) for g in zip(*(g.gaps for g in gs))],
                                         tail=statistics.median(g.tail for g in gs),
                                         steps=[statistics.median(g) for g in zip(*(g.steps for g in gs))])
        out.append(StepTrace(times, buckets, first.blocking, gather, first.fresh_bytes,
                             statistics.median(s.refault for s in same)))
    return out

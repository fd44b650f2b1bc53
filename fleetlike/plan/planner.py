"""The planner: every candidate traced, costed and sized; a table and a recommendation.

`plan` traces each candidate of the search space (`fleetlike.plan.space`) on the planned
cluster (`fleetlike.plan.trace`), predicts its step time (`fleetlike.plan.cost`) and memory
(`fleetlike.plan.memory`), and recommends the fastest candidate that fits the memory limit and
changes the training math only where the caller allowed it. `annotate` writes a trace's
predicted times into a program's listing, so ``print(program)`` shows them next to each
collective.

Example:
    >>> result = plan(spec, Cluster(2, 2), links, allow={MathChange.LOCALSGD})
    >>> print(format_table(result))
    >>> result.recommended.strategy().save("strategy.json")     # fleet reads it as is
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from fleetlike.plan.cost import Links, StepCost, event_cost, step_time
from fleetlike.plan.memory import MemoryBreakdown
from fleetlike.plan.pipeline_rows import MICRO_BATCHES, pipeline_rows
from fleetlike.plan.space import Candidate, MathChange, SpaceName, candidates
from fleetlike.plan.spec import Cluster, ModelSpec
from fleetlike.plan.trace import Trace, trace
from fleetlike.plan.zero import ZERO_CANDIDATES, host_bytes, layout_of, options, zero_memory, zero_step
from fleetlike.program import Program

__all__ = ["PlanResult", "PlanRow", "annotate", "format_table", "plan", "why_not"]


@dataclasses.dataclass
class PlanRow:
    """One candidate's prediction."""

    candidate: Candidate
    cost: StepCost
    memory: MemoryBreakdown
    samples_per_s: float
    fits: bool
    allowed: bool
    #: None for a pipeline candidate (`fleetlike.plan.pipeline_rows`): its stages are timed, not traced
    trace: Trace | None = dataclasses.field(repr=False)
    #: for a candidate derived from another's trace (stages 2 and 3, `fleetlike.plan.zero`):
    #: what it was derived from, and a note for the table (offload's host memory)
    derived: str = ""
    note: str = ""

    @property
    def name(self) -> str:
        return self.candidate.name

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "options": dict(self.candidate.options),
                "changes_math": [m.value for m in self.candidate.changes_math],
                "step_s": self.cost.seconds, "compute_s": self.cost.compute, "exposed_comm_s": self.cost.exposed_comm,
                "comm_s": self.cost.comm, "samples_per_s": self.samples_per_s,
                "intra_bytes_per_step": self.cost.intra_bytes, "inter_bytes_per_step": self.cost.inter_bytes,
                "memory": self.memory.as_dict(), "fits": self.fits, "allowed": self.allowed,
                "period": 1 if self.trace is None else self.trace.period, "derived_from": self.derived or None}


@dataclasses.dataclass
class PlanResult:
    rows: list[PlanRow]
    recommended: PlanRow | None
    cluster: Cluster
    links: Links
    memory_limit: int | None
    why_none: str = ""
    #: candidates that cannot apply to this model, with the engine's reason
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"cluster": str(self.cluster), "links": self.links.source, "memory_limit": self.memory_limit,
                "recommended": None if self.recommended is None else self.recommended.name,
                "rows": [r.as_dict() for r in self.rows], "skipped": [list(s) for s in self.skipped]}


def plan(spec: ModelSpec, cluster: Cluster, links: Links, *, space: SpaceName | str = SpaceName.BASIC,
         allow: Iterable[MathChange] = (), memory_limit: int | None = None,
         only: Iterable[str] | None = None, progress: Callable[[str], None] | None = None,
         host_link: tuple[float, float] | None = None,
         micro_batches: Sequence[int] = MICRO_BATCHES) -> PlanResult:
    """Predict every candidate of ``space`` (or the names in ``only``); see the module docstring.

    ``memory_limit``: bytes per rank; candidates whose predicted peak exceeds it are marked and
    never recommended. Sharding stage 2 is traced through its engine (stage 1's, with transient
    buckets); stage 3 (and offload, priced over ``host_link``) is derived from the data-parallel
    trace (`fleetlike.plan.zero`). Pipeline candidates, one per
    ``pp`` degree dividing the world and count of ``micro_batches``, are predicted by
    `fleetlike.plan.pipeline_rows` (``only`` plans them when it names ``"pipeline"``)."""
    allowed = set(allow)
    cands = candidates(space, cluster)
    zero_names = list(ZERO_CANDIDATES)
    pipelines = True
    if only is not None:
        wanted = list(only)
        names = {c.name: c for c in cands}
        unknown = [w for w in wanted if w not in names and w not in ZERO_CANDIDATES and w != "pipeline"]
        if unknown:
            raise ValueError(f"strategies {unknown} are not in the {space} space on {cluster}; "
                             f"choose from {', '.join([*names, *ZERO_CANDIDATES, 'pipeline'])}")
        pipelines = "pipeline" in wanted
        cands = [names[w] for w in wanted if w in names]
        zero_names = [w for w in wanted if w in ZERO_CANDIDATES]
    rows = []
    skipped: list[tuple[str, str]] = []
    for cand in cands:
        try:
            t = trace(spec, cand.strategy(), cluster)
        except ValueError as exc:  # the strategy cannot apply to this model (e.g. recompute "auto"
            skipped.append((cand.name, str(exc)))  # finds no repeated blocks): shown, not planned
            if progress is not None:
                progress(f"{cand.name}: skipped: {exc}")
            continue
        cost = step_time(t, links)
        fits = memory_limit is None or t.memory.peak <= memory_limit
        rows.append(PlanRow(cand, cost, t.memory, cluster.world_size * spec.batch_size / cost.seconds,
                            fits, all(m in allowed for m in cand.changes_math), t))
        if progress is not None:
            progress(f"{cand.name}: {cost.seconds * 1e3:.1f} ms/step, peak {t.memory.peak / 2**20:.1f} MiB")
    if zero_names:
        rows += _zero_rows(spec, cluster, links, rows, zero_names, memory_limit, host_link, skipped, progress)
    if pipelines:
        rows += _pipeline_rows(spec, cluster, links, memory_limit, micro_batches, skipped, progress)
    ok = [r for r in rows if r.fits and r.allowed]
    best = min(ok, key=lambda r: r.cost.seconds) if ok else None
    why = ""
    if best is None:
        why = ("no candidate fits the memory limit" if not any(r.fits for r in rows)
               else "every candidate that fits changes the training math; pass --allow")
    return PlanResult(rows, best, cluster, links, memory_limit, why, skipped)


def _zero_rows(spec: ModelSpec, cluster: Cluster, links: Links, rows: list[PlanRow], names: list[str],
               memory_limit: int | None, host_link: tuple[float, float] | None, skipped: list[tuple[str, str]],
               progress: Callable[[str], None] | None) -> list[PlanRow]:
    """Stages 2 and 3 (and offload) from the data-parallel trace (`fleetlike.plan.zero`)."""
    if cluster.world_size < 2:
        skipped.extend((n, "one rank: there is nothing to shard") for n in names)
        return []
    base = next((r for r in rows if r.name == "dp"), None)
    if base is None:
        t = trace(spec, Candidate("dp", {}, ()).strategy(), cluster)
        base = PlanRow(Candidate("dp", {}, ()), step_time(t, links), t.memory, 0.0, True, True, t)
    layout = layout_of(spec)
    out = []
    for name in names:
        stage, offload = ZERO_CANDIDATES[name]
        if stage == 2:  # stage 2 runs on the bucket engine: traced through it, as stage 1
            cand = Candidate(name, options(stage, offload), ())
            t = trace(spec, cand.strategy(), cluster)
            cost = step_time(t, links)
            out.append(PlanRow(cand, cost, t.memory, cluster.world_size * spec.batch_size / cost.seconds,
                               memory_limit is None or t.memory.peak <= memory_limit, True, t))
            if progress is not None:
                progress(f"{name}: {cost.seconds * 1e3:.1f} ms/step, peak {t.memory.peak / 2**20:.1f} MiB")
            continue
        if offload and host_link is None:
            skipped.append((name, "not predicted: give the host-device link (--host_link latency_us,MB/s) to price "
                                  "moving the shards; on a CPU-only job offload changes nothing (it is stage 3)"))
            continue
        mem = zero_memory(base.memory, layout, cluster.world_size, stage, offload)
        cost = zero_step(base.trace, base.cost, layout, links, stage, host_link if offload else None)
        note = f"host {_mib(host_bytes(base.memory, cluster.world_size))} MiB" if offload else ""
        out.append(PlanRow(Candidate(name, options(stage, offload), ()), cost, mem,
                           cluster.world_size * spec.batch_size / cost.seconds,
                           memory_limit is None or mem.peak <= memory_limit, True, base.trace, derived="dp", note=note))
        if progress is not None:
            progress(f"{name}: {cost.seconds * 1e3:.1f} ms/step, peak {mem.peak / 2**20:.1f} MiB (from dp's trace)")
    return out


def _pipeline_rows(spec: ModelSpec, cluster: Cluster, links: Links, memory_limit: int | None,
                   micro_batches: Sequence[int], skipped: list[tuple[str, str]],
                   progress: Callable[[str], None] | None) -> list[PlanRow]:
    """The pipeline shapes (`fleetlike.plan.pipeline_rows`) as rows of the table."""
    found, why = pipeline_rows(spec, cluster, links, micro_batches=micro_batches)
    skipped.extend(why)
    out = []
    for p in found:
        pred = p.prediction
        note = f"{pred.schedule}, bubble {pred.bubble:.2f}, imbalance {pred.imbalance:.2f}, dp{pred.dp}"
        out.append(PlanRow(p.candidate, p.cost, p.memory, cluster.world_size * spec.batch_size / p.cost.seconds,
                           memory_limit is None or p.memory.peak <= memory_limit, True, None, note=note))
        if progress is not None:
            progress(f"{p.candidate.name}: {p.cost.seconds * 1e3:.1f} ms/step, peak {p.memory.peak / 2**20:.1f} MiB "
                     f"({note})")
    return out


def why_not(result: PlanResult) -> list[str]:
    """One line per candidate that was not recommended, saying why."""
    best = result.recommended
    lines = []
    for r in sorted(result.rows, key=lambda r: r.cost.seconds):
        if r is best:
            continue
        if not r.fits:
            limit = result.memory_limit or 0
            lines.append(f"{r.name}: does not fit: needs {_mib(r.memory.peak)} MiB per rank, over the "
                         f"{_mib(limit)} MiB limit")
        elif not r.allowed:
            lines.append(f"{r.name}: changes the training math ({', '.join(m.value for m in r.candidate.changes_math)})"
                         ", not allowed (--allow)")
        elif best is not None:
            lines.append(f"{r.name}: fits ({_mib(r.memory.peak)} MiB), but {r.cost.seconds * 1e3:.1f} ms/step is slower "
                         f"than {best.name}'s {best.cost.seconds * 1e3:.1f}")
    return lines


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def format_table(result: PlanResult) -> str:
    """The candidates, fastest first: predicted ms/step, samples/s, MiB sent per step per rank on
    each link, peak MiB per rank; ``*`` marks the recommendation, ``!mem`` a candidate over the
    memory limit, ``(math)`` one that changes the training math and was not allowed."""
    head = f"{'strategy':<24} {'ms/step':>9} {'samples/s':>10} {'intra MiB':>10} {'inter MiB':>10} {'peak MiB':>9}  note"
    lines = [head, "-" * len(head)]
    for r in sorted(result.rows, key=lambda r: r.cost.seconds):
        notes = []
        if r is result.recommended:
            notes.append("* recommended")
        if not r.fits:
            notes.append("!mem")
        if r.candidate.changes_math:
            notes.append("changes math" + ("" if r.allowed else " (not allowed)"))
        if r.derived:
            notes.append(f"from {r.derived}'s trace")
        if r.note:
            notes.append(r.note)
        lines.append(f"{r.name:<24} {r.cost.seconds * 1e3:>9.1f} {r.samples_per_s:>10.1f} "
                     f"{_mib(r.cost.intra_bytes):>10} {_mib(r.cost.inter_bytes):>10} {_mib(r.memory.peak):>9}  "
                     + ", ".join(notes))
    for name, why in result.skipped:
        lines.append(f"{name:<24} skipped: {why}")
    if result.recommended is None:
        lines.append(f"no recommendation: {result.why_none}")
    else:
        lines.append(f"recommended: {result.recommended.name}, the fastest that fits"
                     + ("" if result.memory_limit is None else f" {_mib(result.memory_limit)} MiB per rank"))
    reasons = why_not(result)
    if reasons:
        lines += ["why not the others:", *("  " + r for r in reasons)]
    return "\n".join(lines)


def annotate(program: Program, t: Trace, links: Links) -> Program:
    """Write ``predicted=...`` into the listing of ``program`` (the traced one, or the same
    strategy's ``fleet.main_program`` on the planned cluster): each bucket's collective gets its
    cost on the network, each op issuing blocking collectives their cost per run (averaged over
    the period). Returns ``program``; ``print`` it."""
    cost = step_time(t, links)
    blocking: dict[str, float] = {}
    for s in t.steps:
        for op_type, events in s.blocking:
            blocking[op_type] = blocking.get(op_type, 0.0) + sum(event_cost(e, t.cluster, links) for e in events) / t.period
    for op in program.ops:
        if op.fn is None and op.parent == "backward" and "bucket" in op.attrs:
            c = cost.per_bucket.get(int(op.attrs["bucket"]))
            if c is not None:
                op.attrs["predicted"] = f"{c * 1e3:.2f}ms"
        elif op.type in blocking:
            op.attrs["predicted"] = f"{blocking[op.type] * 1e3:.2f}ms"
    program.notes.append(lambda: f"predicted {cost.seconds * 1e3:.1f} ms/step ({cost.compute * 1e3:.1f} compute, "
                         f"{cost.exposed_comm * 1e3:.1f} exposed communication) with links: {links.source}")
    return program

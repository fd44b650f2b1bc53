"""The "## Pipeline" section of docs/BENCHMARKS.md, its plot and the replays behind it, from
`bench.pipeline`'s results: the run with a core per stage beside the run with the stages
sharing the cores, the slower stage's idle against the bubble, each stage's recorded steps
replayed on the schedule's dependencies (`bench.pipeline_timeline`).

Example:
    >>> add_replays(rows)   # before the rows' timelines are dropped
    >>> text = section(load(pinned_json), load(shared_json), "## Pipeline", "8 blocks ...", 2)
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from bench._common import Column, format_table

__all__ = ["COLUMNS", "HANDOFF_COLUMNS", "P2P_COLUMNS", "RUN_COLUMNS", "SUMMARY_COLUMNS", "add_expected", "add_replays",
           "expected_of", "idle_of", "load", "plot", "section", "slower"]


#: `bench.pipeline_handoff`'s table: one handoff by transport
HANDOFF_COLUMNS = [
    Column("bytes", "message", lambda v: f"{v >> 10} KiB"),
    Column("gloo_us", "gloo one way (us)", "{:.0f}"),
    Column("tcp_us", "raw TCP socket one way (us)", "{:.0f}"),
    Column("shm_us", "shared memory one way (us)", "{:.0f}"),
    Column("gloo_over_shm", "gloo / shared memory", "{:.1f}"),
    Column("gloo_post_us", "gloo isend posting (us)", "{:.0f}"),
    Column("shm_post_us", "shared memory isend posting (us)", "{:.0f}"),
]

def _list(v: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in v)


#: `bench.pipeline_runs`' table: repeated runs summarised
RUN_COLUMNS = [
    Column("schedule", "schedule"), Column("m", "m"), Column("bubble", "(p-1)/(m+p-1)", "{:.3f}"),
    Column("per_run", "slower stage's idle (median step) / bubble, per run", _list),
    Column("median", "median", "{:.2f}"), Column("within", "runs within 20 %"),
    Column("left_out", "left out", lambda v: f"{v}"),
    Column("expected", "expected idle at the measured stages (median of runs)", "{:.3f}"),
    Column("expected_latency", "expected + handoff latency", "{:.3f}"),
    Column("per_run_expected", "idle / expected, per run", _list),
    Column("median_expected", "median ", "{:.2f}"), Column("within_expected", "runs within 20 % "),
    Column("spread", "per-step idle p10-p90 / bubble (median of runs)", lambda v: f"{v[0]:.2f}-{v[1]:.2f}"),
    Column("ratio", "fleetlike / torch, same group (min-max)", lambda v: f"{min(v):.2f}-{max(v):.2f}"),
    Column("ratio_gloo", "fleetlike / torch on gloo (min-max)",
           lambda v: f"{min(v):.2f}-{max(v):.2f}" if v else "-"),
]

COLUMNS = [
    Column("schedule", "schedule"), Column("m", "m"), Column("stage", "stage"),
    Column("fleetlike_steps_s", "fleetlike steps/s", "{:.1f}"), Column("torch_steps_s", "torch steps/s", "{:.1f}"),
    Column("ratio", "ratio", "{:.2f}"), Column("torch_gloo_steps_s", "torch on gloo steps/s", "{:.1f}"),
    Column("ratio_gloo", "ratio to torch on gloo", "{:.2f}"),
    Column("idle_median", "idle, median step", "{:.3f}"),
    Column("idle_p10", "p10", "{:.3f}"), Column("idle_p90", "p90", "{:.3f}"),
    Column("bubble", "(p-1)/(m+p-1)", "{:.3f}"),
    Column("expected_schedule", "expected: stages' ops only", "{:.3f}"),
    Column("expected", "expected: + time outside the schedule", "{:.3f}"),
    Column("expected_latency", "expected: + handoff latency", "{:.3f}"),
    Column("forward_s", "forward (ms)", lambda v: f"{v * 1e3:.2f}"),
    Column("backward_s", "backward (ms)", lambda v: f"{v * 1e3:.2f}"),
    Column("outside_s", "outside the schedule per step (ms)", lambda v: f"{v * 1e3:.1f}"),
    Column("idle", "asleep (schedstat)", "{:.3f}"),
    Column("bubble_measured_stages", "bubble, measured stages", "{:.3f}"),
    Column("waited", "in waits, total over the steps", "{:.3f}"), Column("edges", "fill + drain waits", "{:.3f}"),
    Column("handoffs", "per-micro-batch waits", "{:.3f}"),
    Column("median_wait_us", "median per-micro-batch wait (us)", "{:.0f}"),
    Column("replay_balance", "replay: stages' medians", "{:.3f}"),
    Column("replay_jitter", "replay: recorded times", "{:.3f}"),
    Column("replay_latency", "replay: + handoff latency", "{:.3f}"),
    Column("handoff_us", "handoff latency (us)", "{:.0f}"),
    Column("replay_warmup", "replay: 1 more warm-up forward", lambda v: "-" if v != v else f"{v:.3f}"),
    Column("same_kind_gap_us", "between two forwards or two backwards, median (us)",
           lambda v: "-" if v != v else f"{v:.0f}"),
    Column("first_forward_ratio", "first / median forward", "{:.2f}"),
    Column("forward_spread", "forward p90 / p10", "{:.2f}"),
    Column("gc_per_step", "garbage collections per step", "{:.1f}"), Column("gc_max_ms", "longest collection (ms)", "{:.2f}"),
    Column("runnable", "waiting for a core", "{:.3f}"), Column("not_computing", "not computing", "{:.2f}"),
    Column("peak_micro", "peak activations (micro-batches)", "{:.1f}"),
    Column("predicted_steps_s", "planner steps/s", "{:.1f}"), Column("predicted_ratio", "planner / measured", "{:.2f}")]
P2P_COLUMNS = [Column("bytes", "message", lambda n: f"{n >> 10} KiB"), Column("torch_us", "pipeline's group (us)", "{:.0f}"),
                Column("fleetlike_us", "fleetlike gloo communicator (us)", "{:.0f}"),
                Column("ratio", "torch / fleetlike", "{:.2f}")]
SUMMARY_COLUMNS = [
    Column("schedule", "schedule"), Column("m", "m"), Column("bubble", "(p-1)/(m+p-1)", "{:.3f}"),
    Column("pinned_idle", "idle, a core per stage (median step)", "{:.3f}"), Column("pinned_x", "/ bubble", "{:.2f}"),
    Column("pinned_expected", "expected at the measured stages", "{:.3f}"),
    Column("pinned_xe", "/ expected", "{:.2f}"),
    Column("pinned_core", "waiting for a core", "{:.3f}"),
    Column("shared_idle", "idle, stages sharing the cores", "{:.3f}"), Column("shared_x", "/ bubble ", "{:.2f}"),
    Column("shared_core", "waiting for a core ", "{:.3f}")]


def load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def slower(rows: list[dict[str, Any]], mode: str, m: int) -> dict[str, Any]:
    """The stage that computes longest per micro-batch (its median forward + backward; the
    total compute where a run has no medians): its idle is the pipeline's bubble; the faster
    stage also idles the difference every micro-batch."""
    return max((r for r in rows if (r["schedule"], r["m"]) == (mode, m)),
               key=lambda r: r["forward_s"] + r["backward_s"] if "forward_s" in r else r["compute_s"])


def idle_of(row: dict[str, Any]) -> float:
    """A stage's idle fraction: the clock's time inside the schedule's receives (and the loss's
    handoff) over the step's time, the median over the measured steps (one step a machine
    hiccup stretches moves a total over the steps, not the median); runs saved before the
    per-step record: the total over the steps. Not the kernel's sleeping time: a shared-memory
    receive polls (50 us, then up to 2 ms yielding its core) before it sleeps, and the kernel
    counts that poll as running."""
    return float(row["idle_median"] if "idle_median" in row else row["waited"])


def expected_of(row: dict[str, Any]) -> float:
    """The idle fraction the stage's row expects from the stages' measured op times and time
    outside the schedule (`add_expected`); NaN for runs saved without them."""
    return float(row.get("expected", float("nan")))


def add_expected(rows: list[dict[str, Any]]) -> None:
    """Add to each row the idle fraction its stage would have in back-to-back steps with every
    op at its stage's median time and free handoffs (`bench.pipeline_timeline.expected_idle`):
    ``expected_schedule`` from the forwards and backwards alone (the bubble (p-1)/(m+p-1)
    generalised to unequal stages), ``expected`` with each stage's time outside the schedule
    too (the update: no stage idles then, so it dilutes the fraction), and ``expected_latency``
    with each handoff taking the run's median handoff latency (``handoff_us``, `add_replays`)
    as well: what is left between it and the measured idle is the ops' jitter."""
    from bench.pipeline_timeline import StageTimes, expected_idle

    for mode, m in sorted({(r["schedule"], r["m"]) for r in rows}):
        mine = sorted((r for r in rows if (r["schedule"], r["m"]) == (mode, m)), key=lambda r: r["stage"])
        full = expected_idle(mode, m, [StageTimes(r["forward_s"], r["backward_s"], r["outside_s"]) for r in mine])
        ops = expected_idle(mode, m, [StageTimes(r["forward_s"], r["backward_s"]) for r in mine])
        lat = mine[0].get("handoff_us", float("nan")) * 1e-6
        late = (expected_idle(mode, m, [StageTimes(r["forward_s"], r["backward_s"], r["outside_s"]) for r in mine],
                              latency=lat) if lat == lat else [float("nan")] * len(mine))
        for r, e, o, x in zip(mine, full, ops, late):
            r["expected"], r["expected_schedule"], r["expected_latency"] = e, o, x


def _summary(pinned: dict[str, Any] | None, shared: dict[str, Any] | None) -> list[dict[str, Any]]:
    keys = sorted({(r["schedule"], r["m"]) for run in (pinned, shared) if run for r in run["rows"]})
    out = []
    for mode, m in keys:
        row: dict[str, Any] = {"schedule": mode, "m": m, "bubble": 1 / (m + 1)}
        for name, run in (("pinned", pinned), ("shared", shared)):
            have = run is not None and any((r["schedule"], r["m"]) == (mode, m) for r in run["rows"])
            slow = slower(run["rows"], mode, m) if have and run else None
            row[f"{name}_idle"] = idle_of(slow) if slow else float("nan")
            row[f"{name}_x"] = idle_of(slow) * (m + 1) if slow else float("nan")
            row[f"{name}_expected"] = expected_of(slow) if slow else float("nan")
            row[f"{name}_xe"] = idle_of(slow) / expected_of(slow) if slow else float("nan")
            row[f"{name}_core"] = slow["runnable"] if slow else float("nan")
        out.append(row)
    return out


def _run_line(run: dict[str, Any], how: str, stages: int) -> str:
    cmd = run["info"]["command"]
    return (f"`{cmd}` ({how}; {run['info']['date']}, load average {run['load_end']:.1f} at the end; "
            f"CPUs of stage 0, 1: {' and '.join(str(next(r['cpus'] for r in run['rows'] if r['stage'] == s)) for s in range(stages))})")


def section(pinned: dict[str, Any] | None, shared: dict[str, Any] | None, title: str, setup: str,
            stages: int, runs: dict[str, Any] | None = None, handoff: dict[str, Any] | None = None) -> str:
    """The "## Pipeline" section from the last run with a core per stage and the last run
    with the stages sharing the cores (whichever exist), and ``runs`` (`bench.pipeline_runs`'
    summary of repeated runs) when given."""
    nan = float("nan")
    handing = ("handing over through shared memory (`pipeline_configs.p2p = \"auto\"`), collectives on gloo"
               if (pinned or shared or {}).get("rows", [{}])[0].get("p2p", "gloo") == "auto" else "over gloo")
    parts = [f"{title}\n\n{setup}, {stages} stages on {stages} ranks {handing}, AdamW; fleetlike's `train_batch` and "
             "torch's own schedule on the same split and the pipeline's own group (*ratio*), and torch's schedule "
             "on a plain gloo group, torch's default (*ratio to torch on gloo*), in the same processes, "
             "interleaved rep by rep. A step ends when stage 0's last "
             "backward does: the stage 0 rows are the pipeline's steps/s (stage 1 times torch's step without "
             "the wait for stage 0's tail, which its next step pays). `--pin` (the default where the job may "
             f"use at least {stages} CPUs) runs each rank -- its gloo and torch threads with it, both schedules "
             "-- on its own core, one intra-op and one inter-op thread; `--no-pin` leaves the ranks to share "
             "the cores (one thread each too) and writes `pipeline_shared.json`.\n\n"
             "The pipeline's idle is the slower stage's (the faster one also idles the difference every "
             "micro-batch): the clock's time inside the schedule's receives and the loss's handoff over the "
             "step's time, per step over 30 steps run back to back after 3 left out, their median (*idle, "
             "median step* below; a shared-memory receive polls up to 2 ms before it sleeps, so the kernel's "
             "sleeping time, *asleep* below, leaves part of each wait out). Beside the bubble "
             "(p-1)/(m+p-1), which assumes equal stages and nothing but the schedule in a step, the idle "
             "the run's own measured stage times imply (*expected at the measured stages*: back-to-back "
             "steps replayed with every forward and backward at its stage's median and each stage's "
             "update and other work outside the schedule, handoffs free; `bench.pipeline_timeline."
             "expected_idle`):\n\n"
             + format_table(SUMMARY_COLUMNS, _summary(pinned, shared), markdown=True).replace("nan", "-")
             + "\n\n![pipeline](benchmarks/pipeline.png)\n\n" + _repeated(runs) + _handoff(handoff) + _GLOSSARY]
    for run, how in ((pinned, "a core per stage"), (shared, "stages sharing the cores")):
        if run is None:
            continue
        parts.append(f"\n\n### {how[0].upper() + how[1:]}\n\n{_run_line(run, how, stages)}\n\n"
                     + format_table(COLUMNS, run["rows"], markdown=True).replace(f"{nan}", "-")
                     + "\n\nPing-pong between the two ranks over the pipeline's torch process group (what "
                     "the stages' sends ride) and over fleetlike's own gloo communicator:\n\n" + format_table(P2P_COLUMNS, run["p2p"], markdown=True))
    return "".join(parts) + "\n"


def _handoff(handoff: dict[str, Any] | None) -> str:
    if not handoff:
        return ""
    how = "a core per rank" if handoff["pinned"] else "the ranks sharing the cores"
    return (f"One handoff between the two ranks, by transport (`{handoff['info']['command']}`, {how}, "
            f"{handoff['info']['date']}; a ping-pong through torch's `isend` / `irecv`, except the raw socket; "
            "one way = half the round trip; posting = what `isend` costs the sender before it returns):\n\n"
            + format_table(HANDOFF_COLUMNS, handoff["rows"], markdown=True) + "\n\n")


def _repeated(runs: dict[str, Any] | None) -> str:
    if not runs:
        return ""
    dates = sorted(r["date"] for r in runs["runs"])
    how = "a core per stage" if all(r["pinned"] for r in runs["runs"]) else "some runs sharing the cores"
    dropped = (f"; *left out*: the runs of a row in which a stage waited for a core more than "
               f"{runs['max_core_wait']:.2f} of its steps, another job on its core") if "max_core_wait" in runs else ""
    return (f"Repeated runs ({len(runs['runs'])} of `{runs['runs'][0]['command']}`, {how}, {dates[0]} to "
            f"{dates[-1]}, each under the CPU lock; `python -m bench.pipeline_runs` over their JSON{dropped}):\n\n"
            + format_table(RUN_COLUMNS, runs["rows"], markdown=True) + "\n\n")


_GLOSSARY = (
    "Per stage: *idle, median step*, *p10*, *p90* = the per-step idle fractions' median and spread; "
    "*expected: stages' ops only* = the idle of back-to-back steps with each stage's forwards and backwards "
    "at their median (*forward*, *backward*: each with its share of the schedule's work between ops), "
    "the bubble (p-1)/(m+p-1) generalised to unequal stages; *+ time outside the schedule* = with each "
    "stage's per-step time outside its ops and waits too (*outside the schedule per step*: the update, "
    "slicing the batch; no stage idles then, so it dilutes the fraction); *+ handoff latency* = with each "
    "handoff taking the run's median *handoff latency* as well (the rest up to the measured idle is the "
    "ops' jitter). "
    "Where a stage's time goes, from the kernel's schedstat of its thread over real steps: *asleep* = asleep "
    "in a receive, waiting for its neighbour; *bubble, measured stages* = the bubble that idle would be at "
    "the stages' measured compute (`sum(t) + (m-1) max(t)` for per-micro-batch stage times `t`: stage 1 "
    "computes each block's input gradient, stage 0's first block needs none); *waiting for a core* = "
    "runnable but not running; *not computing* = 1 - (forward, backward and update time) / (step time). "
    "*in waits, total over the steps* = wall time inside the schedule's receives and the loss's handoff "
    "over the steps' total (the clock's idle, the statistic quoted before the per-step median); of it, *fill + drain waits* = the first wait for the neighbour's result, the step's last wait "
    "and the loss's handoff, *per-micro-batch waits* = the rest. *replay*: each stage's recorded forwards "
    "and backwards (their order and durations, one clock for both ranks) replayed on the schedule's "
    "dependencies (`bench/pipeline_timeline.py`), the idle over the measured step time: at each stage's "
    "median forward and backward (the bubble at the stages' balance), at the recorded durations (plus the "
    "jitter from micro-batch to micro-batch), plus the *handoff latency* (median, from an op's end on one "
    "stage to the op needing it starting on its waiting neighbour: the schedule's bookkeeping, the send and "
    "the receive); for 1F1B the same with one more warm-up forward on stage 0 (3 micro-batches of "
    "activations in flight there instead of 2; the replay lets no send hold up a receive, as torch's 1F1B "
    "over gloo does). *between two forwards or two backwards*: the median time "
    "from one op's end to the next same-kind op's start on the stage; stage 0 under GPipe waits for nobody "
    "between its forwards, so there it is the schedule's own work per micro-batch. *first / median forward*: a step's first micro-batch's "
    "forward over its others' median; *forward p90 / p10*: the spread of every micro-batch's forward.")


def add_replays(rows: list[dict[str, Any]]) -> None:
    """Add to each row its stage's idle fraction when the recorded steps are replayed on the
    schedule's dependencies (`bench.pipeline_timeline`): at the stages' median op times, at the
    recorded times, and with the recorded handoff latency too; for 1F1B also with one more
    warm-up forward on every stage but the last. Each over the stage's measured step time."""
    from bench.pipeline_timeline import Op, handoff_latency, median_durations, replay, with_extra_warmup

    for key in sorted({(r["schedule"], r["m"]) for r in rows}):
        mine = sorted((r for r in rows if (r["schedule"], r["m"]) == key), key=lambda r: r["stage"])
        steps = [[[Op(*op) for op in r["timeline"][k]] for r in mine] for k in range(len(mine[0]["timeline"]))]
        lat = handoff_latency(steps)
        medians = median_durations(steps)
        runs = {"replay_balance": [replay(st, 0.0, medians) for st in steps],
                "replay_jitter": [replay(st, 0.0) for st in steps],
                "replay_latency": [replay(st, lat) for st in steps]}
        if key[0] == "1F1B":
            runs["replay_warmup"] = [replay([with_extra_warmup(o) for o in st[:-1]] + [st[-1]], lat) for st in steps]
        for r in mine:
            total = sum(r["step_times"])
            r["handoff_us"] = lat * 1e6
            r["same_kind_gap_us"] = _same_kind_gap([[Op(*op) for op in tl] for tl in r["timeline"]]) * 1e6
            r["replay_warmup"] = float("nan")
            for name, reps in runs.items():
                r[name] = sum(rp.idle[r["stage"]] for rp in reps) / total


def _same_kind_gap(steps: list[list[Any]]) -> float:
    """The median time between the end of one op and the start of the next of the same kind
    (forward after forward, backward after backward) on a stage: under GPipe the first stage's
    forwards wait for nobody, so there it is the schedule's own work per micro-batch (its
    bookkeeping, posting the send); elsewhere it may include a wait. NaN with none."""
    gaps = [b.start - a.end for ops in steps for a, b in zip(ops, ops[1:]) if a.kind == b.kind]
    return statistics.median(gaps) if gaps else float("nan")


def plot(pinned: dict[str, Any] | None, shared: dict[str, Any] | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench._common import save_figure

    main_run = pinned or shared
    if main_run is None:
        return
    rows = main_run["rows"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for mode, marker in (("1F1B", "o"), ("FThenB", "s")):
        first = [r for r in rows if r["schedule"] == mode and r["stage"] == 0]
        ms = [r["m"] for r in first]
        axes[0].plot(ms, [r["ratio"] for r in first], marker=marker, label=mode)
        for run, ls, how in ((pinned, "-", "a core per stage"), (shared, ":", "sharing cores")):
            if run is not None:
                run_ms = sorted({r["m"] for r in run["rows"] if r["schedule"] == mode})
                axes[1].plot(run_ms, [idle_of(slower(run["rows"], mode, m)) for m in run_ms], marker=marker, ls=ls,
                             label=f"{mode}, {how}")
                if run is main_run and all("expected" in r for r in run["rows"]):
                    axes[1].plot(run_ms, [expected_of(slower(run["rows"], mode, m)) for m in run_ms], marker=marker,
                                 ls="-.", alpha=0.6, label=f"{mode}, expected at the measured stages")
        axes[2].plot(ms, [r["peak_micro"] for r in first], marker=marker, label=mode)
    ms = sorted({r["m"] for r in rows})
    axes[1].plot(ms, [1 / (m + 1) for m in ms], "k--", label="(p-1)/(m+p-1)")
    axes[1].fill_between(ms, [0.8 / (m + 1) for m in ms], [1.2 / (m + 1) for m in ms], color="grey", alpha=0.2,
                         label="within 20 %")
    axes[0].axhline(0.9, color="grey", ls=":")
    axes[0].set(title="fleetlike / torch steps/s", xlabel="micro-batches m")
    axes[1].set(title="idle fraction, slower stage", xlabel="micro-batches m")
    axes[2].set(title="peak activations, stage 0 (micro-batches)", xlabel="micro-batches m")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)

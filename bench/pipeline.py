"""Pipeline parallelism: fleetlike's ``train_batch`` beside torch's own schedule, the bubble, and
the activations each schedule keeps.

The model is an ``nn.Sequential`` of 8 blocks (Linear 1024x1024 + GELU), batches of m micro-batches of 16 rows
(width 1024), split by fleetlike into 2 balanced stages on 2 ranks (gloo, one thread each), AdamW.
Three measurements per schedule (1F1B, GPipe) and micro-batch count m:

- steps/s: fleetlike's ``model.train_batch((x, y), opt)`` and torch's ``PipelineStage`` +
  schedule + ``opt.step()`` on the same split and the same process group, interleaved rep by rep
  (`bench._common.interleaved_timings`), median of ``--reps``; the ratio fleetlike / torch;
- where a stage's time goes inside ``--reps`` real steps, from the kernel's schedstat of its
  thread: idle = asleep in a receive, waiting for a neighbour (the pipeline bubble, beside
  (p-1)/(m+p-1) and beside the bubble at the stages' measured compute, ``sum(t) + (m-1) max(t)``
  for per-micro-batch stage times ``t``: unequal stages idle the faster one every micro-batch);
  waiting for a core = runnable but not running (the cores are shared with the other rank's
  gloo threads and with other processes); the same idle from the clock: the time inside the
  schedule's send/receive waits and the loss's broadcast, split into the fill and drain (the
  first wait for the neighbour, the last wait, the loss) and the per-micro-batch waits; not computing = 1 - (its forwards, and each backward
  from its output's gradient arriving to its first block's weight gradient, and the optimizer's
  update) / (the steps' time), the earlier definition of idle, which also counts the waits for a
  core, the schedule's own work and the loss;
- the planner's prediction (`fleetlike.plan.pipeline.predict_pipeline`, stages timed in this
  process on one thread, sends counted free) beside the measured steps/s;
- point-to-point: a ping-pong of 64 KiB - 4 MiB between the ranks over torch's process group
  (what the stages send on) and over fleetlike's own gloo communicator;
- peak activation bytes held per stage: every tensor autograd saves in the stage's blocks
  (``torch.autograd.graph.saved_tensors_hooks``), counted per storage from when it is saved to
  when it is freed, parameters left out; reported in micro-batches' worth (the peak over one
  micro-batch's saved bytes).

Usage (from the repository root)::

    python -m bench.pipeline                 # ~1 minute
    python -m bench.pipeline --reps 5

Writes ``docs/benchmarks/pipeline.json`` and ``.png`` and (re)writes the "## Pipeline" section
of ``docs/BENCHMARKS.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench._common import Column, format_table, interleaved_timings, median, replace_section, run_info, save_json
from fleetlike.plan.pipeline import pipeline_step_seconds
from fleetlike.plan.saved import Metered, SavedBytesMeter

__all__ = ["main", "torch_ping_pong"]

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Pipeline"
BLOCKS, WIDTH, MICRO_ROWS = 8, 1024, 16


def _plain_net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU())
                                 for _ in range(BLOCKS)])


def _net(meter: SavedBytesMeter) -> torch.nn.Sequential:
    return torch.nn.Sequential(*[Metered(block, meter) for block in _plain_net()])


def _rank(role: Any, configs: list[tuple[str, int]], reps: int) -> list[dict[str, Any]]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from fleetlike import DistributedStrategy, fleet

    torch.set_num_threads(1)
    rows = []
    for mode, m in configs:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(m * MICRO_ROWS, WIDTH, generator=g), torch.randn(m * MICRO_ROWS, WIDTH, generator=g)
        s = DistributedStrategy(pipeline=True, pipeline_configs={"accumulate_steps": m, "schedule_mode": mode},
                                hybrid_configs={"pp_degree": 2})
        fleet.init(role, strategy=s)
        meter = SavedBytesMeter()
        model = fleet.distributed_model(_net(meter), loss_fn=F.mse_loss)
        # the parameters and the batch itself are no activations
        meter.params = {p.untyped_storage().data_ptr() for p in model.parameters()} | {x.untyped_storage().data_ptr()}
        opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
        hcg = model.hcg
        # torch's own: the same blocks' copies on the same pipe group
        theirs = _net(SavedBytesMeter())
        blocks = torch.nn.Sequential(*[theirs[int(n)] for n in model.stage.names])
        stage = PipelineStage(blocks, hcg.stage_id, 2, torch.device("cpu"), group=hcg.get_pipe_parallel_process_group())
        sched = (Schedule1F1B if mode == "1F1B" else ScheduleGPipe)(stage, m, loss_fn=F.mse_loss)
        topt = torch.optim.AdamW(blocks.parameters(), lr=1e-4)

        def torch_step() -> None:
            topt.zero_grad()
            if hcg.is_first_stage():
                sched.step(x)
            else:
                sched.step(target=y, losses=[])
            topt.step()

        def fleet_step() -> None:
            model.train_batch((x, y), opt)

        barrier = hcg.get_pipe_parallel_group().barrier
        times = interleaved_timings({"fleetlike": fleet_step, "torch": torch_step}, reps=reps, inner=1,
                                    sync=barrier, warmup=2)
        # the activations each schedule keeps: one metered step
        meter.reset()
        meter.enabled = True
        fleet_step()
        peak = meter.peak
        # one micro-batch's saved bytes, for the unit of the peak
        mb = x[:MICRO_ROWS].clone().requires_grad_(hcg.stage_id > 0)
        if hcg.stage_id == 0:  # stage 0's input is the batch (left out of the step's count too);
            meter.params.add(mb.untyped_storage().data_ptr())  # a later stage's is its receive buffer
        meter.peak = 0
        out = model.stage(mb)
        one = meter.peak
        meter.enabled = False
        del out
        # the stage's busy time inside real steps: its forwards, and each backward from the
        # output's gradient arriving to the first block's weight gradient (the last computed)
        spent = _busy_time(model, opt, fleet_step, reps)
        step = median(times["fleetlike"])
        total = spent["total"]
        rows.append({"schedule": mode, "m": m, "stage": hcg.stage_id, "fleetlike_steps_s": 1 / step,
                     "torch_steps_s": 1 / median(times["torch"]), "ratio": median(times["torch"]) / step,
                     "idle": spent["blocked"] / total, "runnable": spent["runnable"] / total,
                     "not_computing": 1 - (spent["compute"] + spent["update"]) / total,
                     "compute_s": spent["compute"] / reps, "bubble": 1 / (m + 1),
                     "waited": spent["waited"] / total, "edges": spent["edges"] / total,
                     "handoffs": spent["handoffs"] / total, "median_wait_us": spent["median_wait"] * 1e6,
                     "handoff_count": spent["handoff_count"],
                     "peak_bytes": peak, "micro_bytes": one, "peak_micro": peak / max(one, 1)})
        barrier()
        fleet.shutdown()
    return rows


def _thread_sched() -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one) of the calling thread so far;
    NaN where the kernel keeps no schedstat."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            on_cpu, waiting, _ = f.read().split()
        return int(on_cpu) / 1e9, int(waiting) / 1e9
    except (OSError, ValueError):
        return float("nan"), float("nan")


def _busy_time(model: Any, opt: Any, step: Any, reps: int) -> dict[str, float]:
    """Where ``reps`` steps' time went on this stage's thread: ``total``; ``compute`` (its
    forwards, and each backward from the output's gradient arriving to the first block's weight
    gradient, the last computed); ``update`` (the optimizer's); ``on_cpu`` and ``runnable`` (the
    kernel's schedstat: on a core, and ready but waiting for one -- other processes' share of
    the cores); ``blocked`` = the rest: asleep in a receive, waiting for a neighbour."""
    stage = model.stage
    plain = stage._run
    first = next(stage.parameters())
    busy, update, pending = [0.0], [0.0], [0.0]

    def timed(x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        out = plain(x)
        busy[0] += time.perf_counter() - t0
        if out.requires_grad:
            out.register_hook(lambda g: pending.__setitem__(0, time.perf_counter()))
        return out

    def done(p: torch.Tensor) -> None:
        busy[0] += time.perf_counter() - pending[0]

    def timed_step(*args: Any, _plain: Any = opt.step, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return _plain(*args, **kwargs)
        finally:
            update[0] += time.perf_counter() - t0

    handle = first.register_post_accumulate_grad_hook(done)
    stage._run = timed
    opt.step = timed_step
    waits = _WaitLog(model)
    try:
        model.hcg.get_pipe_parallel_group().barrier()
        cpu0, wait0 = _thread_sched()
        t0 = time.perf_counter()
        for _ in range(reps):
            waits.new_step()
            step()
        total = time.perf_counter() - t0
        cpu1, wait1 = _thread_sched()
    finally:
        stage._run = plain
        del opt.step
        handle.remove()
        waits.close()
    on_cpu, runnable = cpu1 - cpu0, wait1 - wait0
    return {"total": total, "compute": busy[0], "update": update[0], "on_cpu": on_cpu, "runnable": runnable,
            "blocked": total - on_cpu - runnable, **waits.summary(model.hcg.is_first_stage())}


class _WaitLog:
    """The seconds this stage's thread spends waiting in each of the schedule's sends and
    receives (torch's ``_wait_batch_p2p``, tagged with the kind of the batch it waits for) and in
    the loss's broadcast, step by step: where its idle time goes."""

    def __init__(self, model: Any) -> None:
        import torch.distributed.pipelining.schedules as sch

        self.sch, self.model = sch, model
        self.plain_batch, self.plain_wait, self.plain_loss = sch._batch_p2p, sch._wait_batch_p2p, model._shared_loss
        self.kinds: dict[int, str] = {}
        self.steps: list[dict[str, Any]] = []
        sch._batch_p2p, sch._wait_batch_p2p = self._batch, self._wait
        model._shared_loss = self._loss

    def new_step(self) -> None:
        self.kinds.clear()
        self.steps.append({"waits": [], "loss": 0.0})

    def _batch(self, ops: Any, desc: str | None = None) -> Any:
        works = self.plain_batch(ops, desc)
        for w in works:
            self.kinds[id(w)] = desc or ""
        return works

    def _wait(self, works: Any) -> None:
        t0 = time.perf_counter()
        self.plain_wait(works)
        if works and self.steps:
            self.steps[-1]["waits"].append((self.kinds.get(id(works[0]), ""), time.perf_counter() - t0))

    def _loss(self, losses: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.plain_loss(losses)
        finally:
            if self.steps:
                self.steps[-1]["loss"] += time.perf_counter() - t0

    def close(self) -> None:
        self.sch._batch_p2p, self.sch._wait_batch_p2p = self.plain_batch, self.plain_wait
        del self.model._shared_loss

    def summary(self, first_stage: bool) -> dict[str, float]:
        """``waited``: all of it; ``edges``: the pipeline's fill and drain -- the first wait for
        a neighbour's result (stage 0: the first gradient; later stages: the first activation),
        the step's last wait and the loss's broadcast (a stage that ends early waits there for
        the others' tails); ``handoffs``: the other waits, one or two per micro-batch (the
        neighbour's result in flight, or late); ``median_wait`` of those."""
        waited = edges = 0.0
        others: list[float] = []
        for st in self.steps:
            waits = st["waits"]
            wanted = "bwd_recv" if first_stage else "fwd_recv"
            ramp = next((i for i, (kind, _) in enumerate(waits) if wanted in kind), None)
            edge_idx = {i for i in (ramp, len(waits) - 1) if i is not None}
            waited += sum(t for _, t in waits) + st["loss"]
            edges += sum(waits[i][1] for i in edge_idx) + st["loss"]
            others += [t for i, (_, t) in enumerate(waits) if i not in edge_idx]
        return {"waited": waited, "edges": edges, "handoffs": waited - edges,
                "median_wait": statistics.median(others) if others else 0.0,
                "handoff_count": len(others) / max(len(self.steps), 1)}


def torch_ping_pong(buf: torch.Tensor, me: int, pg: Any) -> None:
    """``buf`` from stage 0 to stage 1 and back on the torch process group ``pg`` (``me``: this
    rank's stage), as the stages' activations and gradients travel."""
    import torch.distributed as dist

    if me == 0:
        dist.send(buf, group_dst=1, group=pg)
        dist.recv(buf, group_src=1, group=pg)
    else:
        dist.recv(buf, group_src=0, group=pg)
        dist.send(buf, group_dst=0, group=pg)


def _p2p(role: Any, sizes: list[int], reps: int) -> list[dict[str, Any]]:
    """Ping-pong seconds of ``sizes`` bytes between the 2 ranks: over torch's process group (what
    the stages send on) and over fleetlike's own gloo communicator's point-to-point calls."""
    from fleetlike import DistributedStrategy, fleet

    torch.set_num_threads(1)
    fleet.init(role, strategy=DistributedStrategy(pipeline=True, hybrid_configs={"pp_degree": 2}))
    hcg = fleet.get_hybrid_communicate_group()
    comm, pg, me = hcg.get_pipe_parallel_group(), hcg.get_pipe_parallel_process_group(), hcg.get_stage_id()
    rows = []
    for nbytes in sizes:
        buf = torch.zeros(nbytes // 4)

        def on_torch() -> None:
            torch_ping_pong(buf, me, pg)

        def on_fleetlike() -> None:
            other = 1 - me
            if me == 0:
                comm._send_start(buf, other, 7).wait()
                comm._recv_start(buf, other, 7).wait()
            else:
                comm._recv_start(buf, other, 7).wait()
                comm._send_start(buf, other, 7).wait()

        times = interleaved_timings({"torch": on_torch, "fleetlike": on_fleetlike}, reps=reps, inner=5,
                                    sync=comm.barrier, warmup=2)
        rows.append({"bytes": nbytes, "torch_us": median(times["torch"]) * 1e6,
                     "fleetlike_us": median(times["fleetlike"]) * 1e6,
                     "ratio": median(times["torch"]) / median(times["fleetlike"])})
    fleet.shutdown()
    return rows


def _predicted(configs: list[tuple[str, int]]) -> dict[tuple[str, int], float]:
    """`fleetlike.plan.pipeline`'s step seconds for each configuration (one thread, as a rank)."""
    from fleetlike.plan.pipeline import predict_pipeline

    torch.set_num_threads(1)
    out = {}
    for mode, m in configs:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(m * MICRO_ROWS, WIDTH, generator=g), torch.randn(m * MICRO_ROWS, WIDTH, generator=g)
        pred = predict_pipeline(_plain_net(), x, y, F.mse_loss, pp=2, micro_batches=m, schedule=mode)
        out[(mode, m)] = pred.step_s
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--micro", default="4,8,16", help="micro-batch counts")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "pipeline.json"))
    ap.add_argument("--no-docs", action="store_true", help="do not rewrite docs/BENCHMARKS.md")
    args = ap.parse_args(argv)
    from fleetlike.testing import run_ranks

    configs = [(mode, int(m)) for m in args.micro.split(",") for mode in ("1F1B", "FThenB")]
    per_rank = run_ranks(_rank, 2, configs, args.reps, timeout=1200)
    rows = [r for rank_rows in per_rank for r in rank_rows]
    rows.sort(key=lambda r: (r["schedule"], r["m"], r["stage"]))
    predicted = _predicted(configs)
    for r in rows:
        r["predicted_steps_s"] = 1 / predicted[(r["schedule"], r["m"])]
        r["predicted_ratio"] = r["predicted_steps_s"] / r["fleetlike_steps_s"]
        # the bubble at the stages' measured compute: unequal stages leave the faster one idle
        # (the slowest stage's time - its own) every micro-batch, beyond (p-1)/(m+p-1)
        per_micro = [q["compute_s"] / q["m"] for q in rows if (q["schedule"], q["m"]) == (r["schedule"], r["m"])]
        r["bubble_measured_stages"] = 1 - r["compute_s"] / pipeline_step_seconds(per_micro, r["m"])
    cols = [Column("schedule", "schedule"), Column("m", "m"), Column("stage", "stage"),
            Column("fleetlike_steps_s", "fleetlike steps/s", "{:.1f}"), Column("torch_steps_s", "torch steps/s", "{:.1f}"),
            Column("ratio", "ratio", "{:.2f}"), Column("idle", "idle", "{:.2f}"), Column("bubble", "(p-1)/(m+p-1)", "{:.2f}"),
            Column("bubble_measured_stages", "bubble, measured stages", "{:.2f}"),
            Column("waited", "in waits", "{:.2f}"), Column("edges", "fill + drain waits", "{:.2f}"),
            Column("handoffs", "per-micro-batch waits", "{:.2f}"),
            Column("median_wait_us", "median per-micro-batch wait (us)", "{:.0f}"),
            Column("runnable", "waiting for a core", "{:.2f}"), Column("not_computing", "not computing", "{:.2f}"),
            Column("peak_micro", "peak activations (micro-batches)", "{:.1f}"),
            Column("predicted_steps_s", "planner steps/s", "{:.1f}"), Column("predicted_ratio", "planner / measured", "{:.2f}")]
    print(format_table(cols, rows))
    p2p = run_ranks(_p2p, 2, [64 << 10, 1 << 20, 4 << 20], args.reps, timeout=600)[0]
    p2p_cols = [Column("bytes", "message", lambda n: f"{n >> 10} KiB"), Column("torch_us", "torch group (us)", "{:.0f}"),
                Column("fleetlike_us", "fleetlike gloo communicator (us)", "{:.0f}"),
                Column("ratio", "torch / fleetlike", "{:.2f}")]
    print(format_table(p2p_cols, p2p))
    save_json(args.out, {"info": run_info("bench.pipeline", argv), "rows": rows, "p2p": p2p})
    _plot(rows, Path(args.out).with_suffix(".png"))
    if not args.no_docs:
        load = os.getloadavg()[0]
        section = (f"{SECTION}\n\n`python -m bench.pipeline` ({BLOCKS} blocks Linear {WIDTH}x{WIDTH} + GELU, micro-batches of "
                   f"{MICRO_ROWS} rows, 2 stages on 2 gloo ranks, AdamW; fleetlike's `train_batch` and torch's own schedule on "
                   f"the same split, interleaved; {run_info('bench.pipeline', argv)['date']}, load average {load:.1f} at the "
                   "end). A step ends when stage 0's last backward does: the stage 0 rows are the pipeline's steps/s "
                   "(stage 1 times torch's step without the wait for stage 0's tail, which its next step pays).\n\n"
                   "Where a stage's time goes, from the kernel's schedstat of its thread over real steps: *idle* = asleep "
                   "in a receive, waiting for its neighbour; *bubble, measured stages* = the bubble that idle would be at "
                   "the stages' measured compute (`sum(t) + (m-1) max(t)` for per-micro-batch stage times `t`: the faster "
                   "stage also idles the slower one's surplus every micro-batch; stage 1 computes each block's input "
                   "gradient, stage 0's first block needs none); *waiting for a core* = runnable but not running (2 "
                   "cores shared by the 2 ranks, their gloo threads and other jobs); *not computing* = 1 - (forward, "
                   "backward and update time) / (step time), which adds the waits for a core, the schedule's own work "
                   "and the loss to the idle. Compute times are wall clock, so a wait for a core inside a forward counts "
                   "as compute: under load the stage balance moves from run to run. *in waits* = wall time inside the "
                   "schedule's send/receive waits and the loss's broadcast (it should match *idle*: the kernel's figure "
                   "and the clock's); of it, *fill + drain waits* = the first wait for the neighbour's result, the "
                   "step's last wait and the loss's broadcast (the bubble's place), *per-micro-batch waits* = the "
                   "rest, one or two per micro-batch, with their median.\n\n"
                   + format_table(cols, rows, markdown=True) + "\n\n![pipeline](benchmarks/pipeline.png)\n\n"
                   "The stages' sends ride a torch process group; a ping-pong between the two ranks over it and over "
                   "fleetlike's own gloo communicator (both a ProcessGroupGloo on the job's store):\n\n"
                   + format_table(p2p_cols, p2p, markdown=True) + "\n")
        replace_section(ROOT / "docs" / "BENCHMARKS.md", SECTION, section)
    return 0


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench._common import save_figure

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for mode, marker in (("1F1B", "o"), ("FThenB", "s")):
        first = [r for r in rows if r["schedule"] == mode and r["stage"] == 0]
        ms = [r["m"] for r in first]
        axes[0].plot(ms, [r["ratio"] for r in first], marker=marker, label=mode)
        axes[1].plot(ms, [r["idle"] for r in first], marker=marker, label=f"{mode} idle")
        axes[1].plot(ms, [r["bubble_measured_stages"] for r in first], marker=marker, ls=":",
                     label=f"{mode} bubble at measured stages")
        axes[2].plot(ms, [r["peak_micro"] for r in first], marker=marker, label=mode)
    ms = sorted({r["m"] for r in rows})
    axes[1].plot(ms, [1 / (m + 1) for m in ms], "k--", label="(p-1)/(m+p-1)")
    axes[0].axhline(0.9, color="grey", ls=":")
    axes[0].set(title="fleetlike / torch steps/s", xlabel="micro-batches m")
    axes[1].set(title="idle fraction, stage 0", xlabel="micro-batches m")
    axes[2].set(title="peak activations, stage 0 (micro-batches)", xlabel="micro-batches m")
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())

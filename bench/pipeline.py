"""Pipeline parallelism: fleetlike's ``train_batch`` beside torch's own schedule, the bubble, and
the activations each schedule keeps.

The model is an ``nn.Sequential`` of 8 blocks (Linear 1024x1024 + GELU), batches of m micro-batches of 16 rows
(width 1024), split by fleetlike into 2 balanced stages on 2 ranks (handing over through shared
memory, collectives on gloo; one thread each), AdamW.
Three measurements per schedule (1F1B, GPipe) and micro-batch count m:

- steps/s: fleetlike's ``model.train_batch((x, y), opt)`` (its own 1F1B / GPipe step,
  `fleetlike.pipeline.runner`) and torch's ``PipelineStage`` + schedule + ``opt.step()`` on the same split and the same process group (the pipeline's:
  shared memory under ``--p2p auto``, the default), and on a plain gloo group (torch's
  default, under ``--p2p auto``), interleaved rep by rep (`bench._common.interleaved_timings`),
  median of ``--reps``; the ratios fleetlike / torch;
- where a stage's time goes inside ``--reps`` real steps, from the kernel's schedstat of its
  thread: idle = asleep in a receive, waiting for a neighbour (the pipeline bubble, beside
  (p-1)/(m+p-1) and beside the bubble at the stages' measured compute, ``sum(t) + (m-1) max(t)``
  for per-micro-batch stage times ``t``: unequal stages idle the faster one every micro-batch);
  waiting for a core = runnable but not running (the cores are shared with the other rank's
  gloo threads and with other processes); the same idle from the clock: the time inside the
  schedule's receives and the loss's handoff, split into the fill and drain (the
  first wait for the neighbour, the last wait, the loss) and the per-micro-batch waits; not computing = 1 - (its forwards, and each backward
  from its output's gradient arriving to its first block's weight gradient, and the optimizer's
  update) / (the steps' time), the earlier definition of idle, which also counts the waits for a
  core, the schedule's own work and the loss;
- the planner's prediction (`fleetlike.plan.pipeline.predict_pipeline`, stages timed in this
  process on one thread, sends counted free) beside the measured steps/s;
- the same steps replayed (`bench.pipeline_timeline`): each stage's recorded forwards and
  backwards run again on the schedule's dependencies at the stages' median times, at the
  recorded times and with the recorded handoff latency, which splits the idle into the bubble
  at the stages' balance, the jitter and the handoffs (and, for 1F1B, what one more warm-up
  forward on stage 0 would leave);
- the garbage collections inside the timed steps (``gc.callbacks``): how many per step and the
  longest, a source of jitter the process controls;
- point-to-point: a ping-pong of 64 KiB - 4 MiB between the ranks over the pipeline's torch
  process group (what the stages send on) and over fleetlike's own gloo communicator;
- peak activation bytes held per stage: every tensor autograd saves in the stage's blocks
  (``torch.autograd.graph.saved_tensors_hooks``), counted per storage from when it is saved to
  when it is freed, parameters left out; reported in micro-batches' worth (the peak over one
  micro-batch's saved bytes).

Each rank, and every thread it starts (gloo's, torch's), runs on a core of its own (``--pin``,
the default where the job may use at least as many CPUs as stages) on one intra-op and one
inter-op thread; ``--no-pin`` leaves the stages to share the cores, as jobs do by default.

Usage (from the repository root)::

    python -m bench.pipeline                 # ~2 minutes; a core per stage
    python -m bench.pipeline --no-pin        # stages sharing the cores: pipeline_shared.json
    python -m bench.pipeline --micro 16 --no-docs --out /tmp/p.json
    python -m bench.pipeline --p2p gloo      # the stages' handoffs over gloo instead of shared memory
    python -m bench.pipeline --docs-only     # the docs section from the saved JSON files

Writes ``docs/benchmarks/pipeline.json`` (``pipeline_shared.json`` under ``--no-pin``) and
(re)writes the "## Pipeline" section of ``docs/BENCHMARKS.md`` and ``pipeline.png`` from the last
run of each.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench._common import format_table, interleaved_timings, median, replace_section, run_info, save_json
from bench.pipeline_report import COLUMNS, P2P_COLUMNS, add_expected, add_replays, load, plot, section
from fleetlike.plan.pipeline import pipeline_step_seconds
from fleetlike.plan.saved import Metered, SavedBytesMeter

__all__ = ["main", "pin_to_core", "torch_ping_pong"]

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Pipeline"
BLOCKS, WIDTH, MICRO_ROWS, STAGES = 8, 1024, 16, 2


def _plain_net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU())
                                 for _ in range(BLOCKS)])


def _net(meter: SavedBytesMeter) -> torch.nn.Sequential:
    return torch.nn.Sequential(*[Metered(block, meter) for block in _plain_net()])


def pin_to_core(core: int | None) -> list[int]:
    """Run this process -- every thread it has, and (inherited) every thread it starts later:
    gloo's, torch's -- on the one CPU ``core`` (an index into the CPUs this process may use), on
    one intra-op and one inter-op thread; ``None``: leave the affinity alone, threads still 1.
    The CPUs the process may use after, sorted.

    Why: two stages sharing cores take turns on them; a stage that waits for a core falls
    behind and its neighbour idles for it, beyond the schedule's bubble. Pinned, each stage has
    its core (other jobs' processes may still run there: pinning keeps the stages apart, it
    reserves nothing).

    Example:
        >>> pin_to_core(role.rank)   # before fleet.init: gloo's threads inherit the core
    """
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # torch refuses once its inter-op pool has started: it is then as it was
        pass
    cpus = sorted(os.sched_getaffinity(0))
    if core is None:
        return cpus
    if not 0 <= core < len(cpus):
        raise ValueError(f"pin_to_core: core {core} is not one of the {len(cpus)} CPUs this process may use "
                         f"({cpus}). Fix: run with --no-pin, or on at least {core + 1} CPUs")
    for tid in os.listdir("/proc/self/task"):  # sched_setaffinity sets one thread's; new threads inherit
        try:
            os.sched_setaffinity(int(tid), {cpus[core]})
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    return sorted(os.sched_getaffinity(0))


def _rank(role: Any, configs: list[tuple[str, int]], reps: int, pin: bool, p2p: str = "auto",
          idle_steps: int = 30, idle_warmup: int = 3) -> list[dict[str, Any]]:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from fleetlike import DistributedStrategy, fleet

    cpus = pin_to_core(role.rank if pin else None)
    rows = []
    for mode, m in configs:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(m * MICRO_ROWS, WIDTH, generator=g), torch.randn(m * MICRO_ROWS, WIDTH, generator=g)
        s = DistributedStrategy(pipeline=True, hybrid_configs={"pp_degree": 2},
                                pipeline_configs={"accumulate_steps": m, "schedule_mode": mode, "p2p": p2p})
        fleet.init(role, strategy=s)
        meter = SavedBytesMeter()
        model = fleet.distributed_model(_net(meter), loss_fn=F.mse_loss)
        # the parameters and the batch itself are no activations
        meter.params = {p.untyped_storage().data_ptr() for p in model.parameters()} | {x.untyped_storage().data_ptr()}
        opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
        hcg = model.hcg
        def torch_on(group: Any) -> Any:
            """torch's own schedule: the same blocks' copies on ``group``."""
            theirs = _net(SavedBytesMeter())
            blocks = torch.nn.Sequential(*[theirs[int(n)] for n in model.stage.names])
            stage = PipelineStage(blocks, hcg.stage_id, 2, torch.device("cpu"), group=group)
            sched = (Schedule1F1B if mode == "1F1B" else ScheduleGPipe)(stage, m, loss_fn=F.mse_loss)
            topt = torch.optim.AdamW(blocks.parameters(), lr=1e-4)

            def torch_step() -> None:
                topt.zero_grad()
                if hcg.is_first_stage():
                    sched.step(x)
                else:
                    sched.step(target=y, losses=[])
                topt.step()
            return torch_step

        def fleet_step() -> None:
            model.train_batch((x, y), opt)

        # torch's schedule on the pipeline's own group (the same handoffs: the schedules
        # compared) and, when that group shares memory, on a plain gloo group (torch's default)
        fns = {"fleetlike": fleet_step, "torch": torch_on(hcg.get_pipe_parallel_process_group())}
        if p2p == "auto":
            fns["torch_gloo"] = torch_on(dist.new_group([0, 1]))
        barrier = hcg.get_pipe_parallel_group().barrier
        times = interleaved_timings(fns, reps=reps, inner=1, sync=barrier, warmup=2)
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
        spent = _busy_time(model, opt, fleet_step, idle_steps, idle_warmup)
        step = median(times["fleetlike"])
        total = spent["total"]
        rows.append({"schedule": mode, "m": m, "stage": hcg.stage_id, "fleetlike_steps_s": 1 / step,
                     "torch_steps_s": 1 / median(times["torch"]), "ratio": median(times["torch"]) / step,
                     **({"torch_gloo_steps_s": 1 / median(times["torch_gloo"]),
                         "ratio_gloo": median(times["torch_gloo"]) / step} if "torch_gloo" in times else {}),
                     "p2p": p2p,
                     "idle": spent["blocked"] / total, "runnable": spent["runnable"] / total,
                     "not_computing": 1 - (spent["compute"] + spent["update"]) / total,
                     "compute_s": spent["compute"] / idle_steps, "bubble": 1 / (m + 1),
                     "idle_steps": spent["idle_steps"], "idle_median": statistics.median(spent["idle_steps"]),
                     "idle_p10": _quantile(spent["idle_steps"], 0.1), "idle_p90": _quantile(spent["idle_steps"], 0.9),
                     "forward_s": spent["forward_s"], "backward_s": spent["backward_s"],
                     "outside_s": spent["outside_s"], "steps_measured": idle_steps, "warmup_steps": idle_warmup,
                     "waited": spent["waited"] / total, "edges": spent["edges"] / total,
                     "handoffs": spent["handoffs"] / total, "median_wait_us": spent["median_wait"] * 1e6,
                     "handoff_count": spent["handoff_count"], "cpus": cpus,
                     "first_forward_ratio": spent["first_forward_ratio"],
                     "forward_spread": spent["forward_spread"], "backward_spread": spent["backward_spread"],
                     "timeline": spent["timeline"], "step_times": spent["step_times"],
                     "gc_per_step": spent["gc_per_step"], "gc_s": spent["gc_s"], "gc_max_ms": spent["gc_max_ms"],
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


def _quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank below)."""
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def _busy_time(model: Any, opt: Any, step: Any, reps: int, warmup: int = 0) -> dict[str, Any]:
    """Where ``reps`` steps' time went on this stage's thread, after ``warmup`` steps run
    back to back and left out (the first steps after the barrier fill the pipeline from
    rest; caches and the allocator settle): ``total``; ``compute`` (its
    forwards, and each backward from the output's gradient arriving to the first block's weight
    gradient, the last computed); ``update`` (the optimizer's); ``on_cpu`` and ``runnable`` (the
    kernel's schedstat: on a core, and ready but waiting for one -- other processes' share of
    the cores); ``blocked`` = the rest: asleep in a receive, waiting for a neighbour.
    Step by step: ``idle_steps``, each step's time in the schedule's waits over the step's
    time (the statistic the docs quote is their median: one step that a machine hiccup
    stretches moves a total, not a median); ``forward_s`` / ``backward_s``, the median forward
    and backward, each with its share of the schedule's work between ops (the steps' median);
    ``outside_s``, the median step's time outside its ops and waits (the update, the loss's
    handoff, slicing the batch): what `bench.pipeline_timeline.expected_idle` needs."""
    stage = model.stage
    plain = stage._run
    first = next(stage.parameters())
    busy, update, pending = [0.0], [0.0], [0.0]
    forwards: list[list[float]] = []  # per step, each micro-batch's forward seconds in order
    backwards: list[list[float]] = []
    timeline: list[list[tuple[str, int, float, float]]] = []  # per step, (kind, micro, start, end) in order

    def timed(x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        out = plain(x)
        t1 = time.perf_counter()
        spent = t1 - t0
        busy[0] += spent
        timeline[-1].append(("F", len(forwards[-1]), t0, t1))
        forwards[-1].append(spent)
        if out.requires_grad:
            out.register_hook(lambda g: pending.__setitem__(0, time.perf_counter()))
        return out

    def done(p: torch.Tensor) -> None:
        t1 = time.perf_counter()
        spent = t1 - pending[0]
        busy[0] += spent
        timeline[-1].append(("B", len(backwards[-1]), pending[0], t1))
        backwards[-1].append(spent)

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
    step_times: list[float] = []
    bounds: list[tuple[float, float]] = []
    collections: list[float] = []  # seconds of each garbage collection inside the steps
    started = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            collections.append(time.perf_counter() - started[0])

    gc.callbacks.append(on_gc)
    try:
        model.hcg.get_pipe_parallel_group().barrier()
        for _ in range(warmup):
            waits.new_step()
            forwards.append([])
            backwards.append([])
            timeline.append([])
            step()
        for kept in (forwards, backwards, timeline, waits.steps, collections):
            kept.clear()
        busy[0] = update[0] = 0.0
        cpu0, wait0 = _thread_sched()
        t0 = time.perf_counter()
        for _ in range(reps):
            waits.new_step()
            forwards.append([])
            backwards.append([])
            timeline.append([])
            t_step = time.perf_counter()
            step()
            step_times.append(time.perf_counter() - t_step)
            bounds.append((t_step, t_step + step_times[-1]))
        total = time.perf_counter() - t0
        cpu1, wait1 = _thread_sched()
    finally:
        gc.callbacks.remove(on_gc)
        stage._run = plain
        del opt.step
        handle.remove()
        waits.close()
    on_cpu, runnable = cpu1 - cpu0, wait1 - wait0
    return {"total": total, "compute": busy[0], "update": update[0], "on_cpu": on_cpu, "runnable": runnable,
            "blocked": total - on_cpu - runnable, **waits.summary(model.hcg.is_first_stage()),
            **_uniformity(forwards, backwards), "timeline": timeline, "step_times": step_times,
            **_per_step(timeline, waits.steps, step_times),
            "gc_per_step": len(collections) / reps, "gc_s": sum(collections) / total,
            "gc_max_ms": max(collections, default=0.0) * 1e3}


def _per_step(timeline: list[list[tuple[str, int, float, float]]], waits: list[dict[str, Any]],
              step_times: list[float]) -> dict[str, Any]:
    """Per step: the idle fraction (time in waits / step time); and the stage's typical op
    and outside times for the expectation (see `_busy_time`)."""
    idle, gaps, outside = [], [], []
    for ops, st, took in zip(timeline, waits, step_times):
        waited = sum(t1 - t0 for _, t0, t1 in st["waits"]) + st["loss"]
        idle.append(waited / took)
        first, last = ops[0][2], ops[-1][3]
        inside = sum(t1 - t0 for _, t0, t1 in st["waits"] if t0 >= first and t1 <= last)
        # between the ops: the schedule's bookkeeping, posting sends, the last stage's loss
        gaps.append(max(0.0, (last - first) - sum(e - b for _, _, b, e in ops) - inside))
        outside.append(max(0.0, took - (last - first) - (waited - inside)))
    m = sum(1 for op in timeline[0] if op[0] == "F")
    share = statistics.median(gaps) / (2 * m)
    return {"idle_steps": idle, "outside_s": statistics.median(outside),
            "forward_s": statistics.median([e - b for ops in timeline for k, _, b, e in ops if k == "F"]) + share,
            "backward_s": statistics.median([e - b for ops in timeline for k, _, b, e in ops if k == "B"]) + share}


def _uniformity(forwards: list[list[float]], backwards: list[list[float]]) -> dict[str, float]:
    """Is each micro-batch's compute the same? ``first_forward_ratio``: the step's first forward
    over the median of its others (a warm-up, an allocator's first touch would show above 1),
    median over the steps; ``forward_spread`` / ``backward_spread``: the 90th over the 10th
    percentile of every micro-batch's forward / backward seconds (1.0: all equal)."""
    def spread(values: list[float]) -> float:
        ordered = sorted(values)
        if len(ordered) < 2:
            return float("nan")
        return ordered[int(0.9 * (len(ordered) - 1))] / max(ordered[int(0.1 * (len(ordered) - 1))], 1e-12)

    firsts = [f[0] / statistics.median(f[1:]) for f in forwards if len(f) > 1]
    return {"first_forward_ratio": statistics.median(firsts) if firsts else float("nan"),
            "forward_spread": spread([t for f in forwards for t in f]),
            "backward_spread": spread([t for b in backwards for t in b])}


class _WaitLog:
    """The seconds this stage's thread spends waiting in each of the schedule's receives
    (`fleetlike.pipeline.runner.StageRunner._recv`, tagged ``fwd_recv`` or ``bwd_recv``) and in
    the loss's broadcast, step by step: where its idle time goes."""

    def __init__(self, model: Any) -> None:
        self.model, self.runner = model, model.runner
        self.plain_recv, self.plain_loss = self.runner._recv, model._shared_loss
        self.steps: list[dict[str, Any]] = []
        self.runner._recv = self._recv
        model._shared_loss = self._loss

    def new_step(self) -> None:
        self.steps.append({"waits": [], "loss": 0.0})

    def _recv(self, into: Any, peer: int, kind: str) -> None:
        t0 = time.perf_counter()
        self.plain_recv(into, peer, kind)
        if self.steps and kind != "loss_recv":  # the loss's handoff is timed with `_loss`
            self.steps[-1]["waits"].append((kind, t0, time.perf_counter()))

    def _loss(self, losses: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.plain_loss(losses)
        finally:
            if self.steps:
                self.steps[-1]["loss"] += time.perf_counter() - t0

    def close(self) -> None:
        del self.runner._recv
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
            took = [t1 - t0 for _, t0, t1 in waits]
            ramp = next((i for i, (kind, _, _) in enumerate(waits) if wanted in kind), None)
            edge_idx = {i for i in (ramp, len(waits) - 1) if i is not None}
            waited += sum(took) + st["loss"]
            edges += sum(took[i] for i in edge_idx) + st["loss"]
            others += [t for i, t in enumerate(took) if i not in edge_idx]
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


def _p2p(role: Any, sizes: list[int], reps: int, pin: bool, p2p: str = "auto") -> list[dict[str, Any]]:
    """Ping-pong seconds of ``sizes`` bytes between the 2 ranks: over the pipeline's torch
    process group (what the stages send on) and over fleetlike's own gloo communicator's
    point-to-point calls."""
    from fleetlike import DistributedStrategy, fleet

    pin_to_core(role.rank if pin else None)
    fleet.init(role, strategy=DistributedStrategy(pipeline=True, hybrid_configs={"pp_degree": 2},
                                                  pipeline_configs={"p2p": p2p}))
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


def _block_split() -> dict[str, Any]:
    """Each block's forward + backward ms on one micro-batch (`fleetlike.pipeline.split.
    block_seconds`, one thread, median of 15; the first block computes no input gradient), the
    split `pipeline_configs.balance = "time"` makes of them, and each stage's ms at every
    contiguous 2-stage split: whether a better balanced split exists."""
    from fleetlike.pipeline.split import block_seconds, plan_stages

    torch.set_num_threads(1)
    net = _plain_net()
    per = [t for _, t in block_seconds(net, torch.randn(MICRO_ROWS, WIDTH), reps=15)]
    plan = plan_stages(net, STAGES, seconds=per)
    return {"block_ms": [t * 1e3 for t in per], "time_split": [plan.names(s) for s in range(STAGES)],
            "params_split": [plan_stages(net, STAGES).names(s) for s in range(STAGES)],
            "stage_ms_by_split": {str(k): [sum(per[:k]) * 1e3, sum(per[k:]) * 1e3] for k in range(1, BLOCKS)}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7, help="steps per implementation in the steps/s comparison")
    ap.add_argument("--idle-steps", type=int, default=30,
                    help="steps back to back whose idle is measured, per schedule and m (the median of their "
                         "per-step idle fractions is quoted)")
    ap.add_argument("--idle-warmup", type=int, default=3, help="steps run before those and left out")
    ap.add_argument("--micro", default="4,8,16", help="micro-batch counts")
    ap.add_argument("--out", default=None, help="the JSON to write (default docs/benchmarks/pipeline.json, "
                    "pipeline_shared.json under --no-pin); the docs section reads both defaults")
    ap.add_argument("--no-docs", action="store_true", help="do not rewrite docs/BENCHMARKS.md")
    ap.add_argument("--docs-only", action="store_true",
                    help="run nothing: rewrite the docs section and plot from the saved JSON files")
    ap.add_argument("--p2p", choices=("auto", "gloo"), default="auto",
                    help="pipeline_configs.p2p of fleetlike's pipeline (auto: shared memory between the stages)")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=None,
                    help="each rank (both schedules) on its own core, one thread; default: on where this "
                         f"process may use at least {STAGES} CPUs")
    args = ap.parse_args(argv)
    from fleetlike.testing import run_ranks

    if args.docs_only:
        _write_docs()
        return 0
    pin = len(os.sched_getaffinity(0)) >= STAGES if args.pin is None else args.pin

    configs = [(mode, int(m)) for m in args.micro.split(",") for mode in ("1F1B", "FThenB")]
    per_rank = run_ranks(_rank, STAGES, configs, args.reps, pin, args.p2p, args.idle_steps, args.idle_warmup,
                         timeout=1200)
    rows = [r for rank_rows in per_rank for r in rank_rows]
    rows.sort(key=lambda r: (r["schedule"], r["m"], r["stage"]))
    predicted = _predicted(configs)
    blocks = _block_split()
    print(f"blocks' forward + backward (ms): {[round(t, 2) for t in blocks['block_ms']]}; split by time "
          f"{blocks['time_split']}, by parameters {blocks['params_split']}")
    for r in rows:
        r["predicted_steps_s"] = 1 / predicted[(r["schedule"], r["m"])]
        r["predicted_ratio"] = r["predicted_steps_s"] / r["fleetlike_steps_s"]
        # the bubble at the stages' measured compute: unequal stages leave the faster one idle
        # (the slowest stage's time - its own) every micro-batch, beyond (p-1)/(m+p-1)
        per_micro = [q["compute_s"] / q["m"] for q in rows if (q["schedule"], q["m"]) == (r["schedule"], r["m"])]
        r["bubble_measured_stages"] = 1 - r["compute_s"] / pipeline_step_seconds(per_micro, r["m"])
    add_replays(rows)
    add_expected(rows)
    print(format_table(COLUMNS, rows))
    p2p = run_ranks(_p2p, STAGES, [64 << 10, 1 << 20, 4 << 20], args.reps, pin, args.p2p, timeout=600)[0]
    print(format_table(P2P_COLUMNS, p2p))
    out = Path(args.out if args.out else _default_out(pin))
    for r in rows:  # the replays above read them; thousands of numbers a reader does not need
        del r["timeline"]
    save_json(out, {"info": run_info("bench.pipeline", argv), "pinned": pin,
                    "load_end": os.getloadavg()[0],
                    "rows": rows, "p2p": p2p, "blocks": blocks})
    if not args.no_docs:
        _write_docs()
    else:
        plot(load(out) if pin else None, None if pin else load(out), out.with_suffix(".png"))
    return 0


def _write_docs() -> None:
    """The "## Pipeline" section of docs/BENCHMARKS.md and its plot, from the saved runs."""
    pinned, shared = load(_default_out(True)), load(_default_out(False))
    plot(pinned, shared, ROOT / "docs" / "benchmarks" / "pipeline.png")
    setup = f"{BLOCKS} blocks Linear {WIDTH}x{WIDTH} + GELU, micro-batches of {MICRO_ROWS} rows"
    runs = load(ROOT / "docs" / "benchmarks" / "pipeline_runs.json")
    handoff = load(ROOT / "docs" / "benchmarks" / "pipeline_handoff.json")
    replace_section(ROOT / "docs" / "BENCHMARKS.md", SECTION,
                    section(pinned, shared, SECTION, setup, STAGES, runs, handoff))


def _default_out(pin: bool) -> Path:
    return ROOT / "docs" / "benchmarks" / ("pipeline.json" if pin else "pipeline_shared.json")


if __name__ == "__main__":
    sys.exit(main())

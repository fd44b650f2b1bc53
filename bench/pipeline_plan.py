"""The pipeline planner against real pipelined jobs: predicted / measured step time and memory.

`fleetlike.plan.pipeline.predict_pipeline` predicts a pipeline from its stages timed one after
another in one process (one torch thread, as a rank runs) and its tensors counted. This script
runs the same model for real, 2 stages on 2 gloo ranks (``fleet.distributed_model`` +
``train_batch``, AdamW), for each schedule (1F1B, GPipe) and micro-batch count ``--micro``, and
prints each figure beside its prediction as a ratio predicted / measured:

- step time: the median over ``--reps`` steps, each started by a barrier of the pipeline (the
  pipeline's step is its slower rank's); predicted ``step_s`` twice: with the sends free (the
  planner without link figures) and with the sends costed on link figures fitted to a
  ping-pong between the same two ranks in the same job (``Links.from_rates``, what
  ``python -m fleetlike.plan --probe`` gives a real cluster);
- per stage, the compute of one micro-batch (forward + backward): measured inside the job with
  both ranks computing at once (the cores and the memory bus shared as in the pipeline) beside
  the planner's figure timed alone;
- per rank, tensor bytes held: parameters, gradients and the optimizer state after a step
  (exact), and the peak of the bytes autograd saves during a step (each storage once, the
  parameters left out), beside ``held_micro_batches x activation_bytes``;
- per rank, the peak RSS above the rank's RSS before the model was built (glibc's mmap
  threshold at 128 KiB with ``mallopt``, so freed blocks return to the system; the steps'
  own peak, the build's transient whole model left out), beside the planner's peak
  (parameters + gradients + optimizer state + the larger of the activations and the update's
  temporaries, as ``python -m fleetlike.plan`` prints it).

Usage (from the repository root)::

    python -m bench.pipeline_plan              # ~2 minutes on 2 cores
    python -m bench.pipeline_plan --micro 2,4,8,16 --reps 9

Writes ``docs/benchmarks/pipeline_plan.json`` and ``.png`` and (re)writes the "## Pipeline
planner: predicted vs measured" section of ``docs/BENCHMARKS.md``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench._common import Column, format_table, median, plot_panels, proc_status, replace_section, run_info, save_json
from bench.pipeline import BLOCKS, MICRO_ROWS, WIDTH, _net, _plain_net, torch_ping_pong
from fleetlike.plan.memory import optimizer_state_bytes
from fleetlike.plan.saved import SavedBytesMeter
from fleetlike.testing import run_ranks

__all__ = ["main", "predictions"]

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Pipeline planner: predicted vs measured"
LR = 1e-4


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM back to the current RSS


def _batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(m * MICRO_ROWS, WIDTH, generator=g), torch.randn(m * MICRO_ROWS, WIDTH, generator=g)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _compute_together(model: Any, x: torch.Tensor, barrier: Any, reps: int) -> float:
    """Median seconds of this stage's forward + backward of one micro-batch (the last stage's
    with the loss), both ranks computing at once between barriers."""
    stage, last = model.stage, model.hcg.is_last_stage()
    src = x[:MICRO_ROWS].clone().requires_grad_(not model.hcg.is_first_stage())
    target = torch.zeros(MICRO_ROWS, WIDTH)

    def once() -> None:
        out = stage(src)
        (F.mse_loss(out, target) if last else out.sum()).backward()

    once()
    times = []
    for _ in range(reps):
        barrier()
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    for p in stage.parameters():
        p.grad = None
    return median(times)


def _rank(role: Any, configs: list[tuple[str, int]], reps: int, memory: bool) -> list[dict[str, Any]]:
    """Each configuration as a real pipelined job on this rank: with ``memory``, its bytes
    (glibc's mmap threshold at 128 KiB, so the RSS follows what is held); else its step time
    and stage compute, with glibc's default allocator (the threshold also makes every freed
    4 MiB gradient go back to the system and come back as fresh pages: timed with it, the
    stages' compute was 1.6-1.9x slower)."""
    if memory:
        ctypes.CDLL("libc.so.6").mallopt(-3, 131072)  # M_MMAP_THRESHOLD: freed blocks go back to the system
    torch.set_num_threads(1)
    from fleetlike import DistributedStrategy, fleet

    # one untimed job first: the process's one-time allocations (gloo's and torch's lazy
    # initialisation) would otherwise land in the first configuration's figures
    warm = DistributedStrategy(pipeline=True, pipeline_configs={"accumulate_steps": 2}, hybrid_configs={"pp_degree": 2})
    fleet.init(role, strategy=warm)
    model = fleet.distributed_model(_plain_net(), loss_fn=F.mse_loss)
    opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=LR))
    model.train_batch(_batch(2), opt)
    del model, opt
    fleet.shutdown()
    rows = []
    for mode, m in configs:
        x, y = _batch(m)
        s = DistributedStrategy(pipeline=True, pipeline_configs={"accumulate_steps": m, "schedule_mode": mode},
                                hybrid_configs={"pp_degree": 2})
        fleet.init(role, strategy=s)
        gc.collect()
        base = proc_status("VmRSS")
        meter = SavedBytesMeter()
        model = fleet.distributed_model(_net(meter), loss_fn=F.mse_loss)
        opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=LR))
        hcg = model.hcg
        barrier = hcg.get_pipe_parallel_group().barrier

        def step() -> None:
            model.train_batch((x, y), opt)

        for _ in range(2):  # the shapes agreed, the optimizer state made
            step()
        gc.collect()
        _reset_peak()
        times = []
        for _ in range(reps if not memory else 2):
            barrier()
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        row: dict[str, Any] = {"schedule": mode, "m": m, "stage": hcg.stage_id}
        if memory:
            row["rss_peak"] = proc_status("VmHWM") - base
            params = list(model.parameters())
            row.update(param_bytes=sum(_nbytes(p) for p in params), grad_bytes=sum(_nbytes(p.grad) for p in params),
                       optimizer_bytes=optimizer_state_bytes(opt))
            # the bytes autograd saves during one step: parameters and the batch are no activations
            meter.params = {p.untyped_storage().data_ptr() for p in params} | {x.untyped_storage().data_ptr()}
            meter.reset()
            meter.enabled = True
            barrier()
            step()
            meter.enabled = False
            row["activation_peak"] = meter.peak
        else:
            row["step_s"] = median(times)
            row["compute_s"] = _compute_together(model, x, barrier, reps)
        rows.append(row)
        barrier()
        del model, opt
        fleet.shutdown()
    return rows


def _probe(role: Any, sizes: list[int], reps: int) -> dict[str, Any]:
    """What ``python -m fleetlike.plan --probe`` measures, on the pipeline's two ranks: one-way
    seconds of a send of each size on the pipeline's torch process group (what the stages send
    on; half a ping-pong's median), and the slowdown of the probe's reference kernel when both
    ranks compute at once (`fleetlike.plan.probe.compute_slowdown`: ``Links.compute_scale``)."""
    from fleetlike import DistributedStrategy, fleet
    from fleetlike.plan.probe import compute_slowdown, kernel_seconds

    torch.set_num_threads(1)
    fleet.init(role, strategy=DistributedStrategy(pipeline=True, hybrid_configs={"pp_degree": 2}))
    hcg = fleet.get_hybrid_communicate_group()
    scale, alone, together = compute_slowdown(hcg.get_pipe_parallel_group(), kernel_seconds)
    pg, me, barrier = hcg.get_pipe_parallel_process_group(), hcg.get_stage_id(), hcg.get_pipe_parallel_group().barrier
    out = []
    for nbytes in sizes:
        buf = torch.zeros(nbytes // 4)
        times = []
        for rep in range(reps + 2):
            barrier()
            t0 = time.perf_counter()
            for _ in range(5):
                torch_ping_pong(buf, me, pg)
            if rep >= 2:
                times.append((time.perf_counter() - t0) / 10)
        out.append((nbytes, median(times)))
    fleet.shutdown()
    return {"one_way": out, "compute_scale": scale, "kernel_alone_s": alone, "kernel_together_s": together}


def _links(probe: dict[str, Any]) -> Any:
    """``Links`` of one node of 2 ranks: sends as latency + bytes / rate through two one-way
    times, and the probe's compute scale."""
    from fleetlike.plan import Cluster, Links

    (n0, t0), (n1, t1) = probe["one_way"][0], probe["one_way"][-1]
    per_byte = max((t1 - t0) / (n1 - n0), 1e-12)
    latency = max(t0 - per_byte * n0, 1e-7)
    return Links.from_rates(intra=(latency, 1 / per_byte), inter=(latency, 1 / per_byte), cluster=Cluster(1, 2),
                            compute_scale=probe["compute_scale"])


def predictions(configs: list[tuple[str, int]], links: Any = None, reps: int = 7) -> dict[tuple[str, int], Any]:
    """`predict_pipeline` of each configuration (one thread, as a rank), with ``links`` or free sends."""
    from fleetlike.plan import Cluster
    from fleetlike.plan.pipeline import predict_pipeline

    torch.set_num_threads(1)
    out = {}
    for mode, m in configs:
        x, y = _batch(m)
        out[(mode, m)] = predict_pipeline(_plain_net(), x, y, F.mse_loss, pp=2, micro_batches=m, schedule=mode,
                                          optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR), links=links,
                                          cluster=Cluster(1, 2) if links is not None else None, reps=reps)
    return out


COLUMNS = [
    Column("schedule", "schedule"), Column("m", "m"), Column("stage", "stage"),
    Column("step_ms", "step ms", "{:.1f}"), Column("pred_free", "planner / measured, no links", "{:.2f}"),
    Column("pred_links", "planner / measured, probed links", "{:.2f}"),
    Column("compute_ms", "stage compute ms (both ranks at once)", "{:.2f}"),
    Column("compute_ratio_alone", "planner / measured compute, alone", "{:.2f}"),
    Column("compute_ratio", "planner / measured compute, scaled", "{:.2f}"),
    Column("state_ratio", "planner / measured params+grads+opt", "{:.3f}"),
    Column("act_mib", "activation peak MiB", "{:.2f}"), Column("act_ratio", "planner / measured activations", "{:.2f}"),
    Column("rss_mib", "RSS peak MiB", "{:.1f}"), Column("rss_ratio", "planner / measured RSS", "{:.2f}"),
]


def _compare(rows: list[dict[str, Any]], free: dict[Any, Any], costed: dict[Any, Any]) -> None:
    from fleetlike.plan.pipeline import stage_memory

    for r in rows:
        key = (r["schedule"], r["m"])
        pair = [q for q in rows if (q["schedule"], q["m"]) == key]
        step = max(q["step_s"] for q in pair)  # the pipeline's step is its slower rank's
        sp = free[key].stages[r["stage"]]
        r["step_ms"] = step * 1e3
        r["pred_free"] = free[key].step_s / step
        r["pred_links"] = costed[key].step_s / step
        r["compute_ms"] = r["compute_s"] * 1e3
        sl = costed[key].stages[r["stage"]]
        r["compute_ratio_alone"] = (sp.forward_s + sp.backward_s) / r["compute_s"]
        r["compute_ratio"] = (sl.forward_s + sl.backward_s) / r["compute_s"]
        state = r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]
        r["state_ratio"] = (2 * sp.param_bytes + sp.optimizer_bytes) / state
        r["act_mib"] = r["activation_peak"] / 2**20
        r["act_ratio"] = sp.held_micro_batches * sp.activation_bytes / max(r["activation_peak"], 1)
        r["rss_mib"] = r["rss_peak"] / 2**20
        r["predicted_peak"] = stage_memory(sp).peak
        r["rss_ratio"] = r["predicted_peak"] / r["rss_peak"]
        r["predicted"] = {"step_s_free": free[key].step_s, "step_s_links": costed[key].step_s,
                          "forward_s": sp.forward_s, "backward_s": sp.backward_s, "send_s": costed[key].stages[r["stage"]].send_s,
                          "param_bytes": sp.param_bytes, "optimizer_bytes": sp.optimizer_bytes,
                          "activation_bytes": sp.activation_bytes, "held_micro_batches": sp.held_micro_batches,
                          "update_bytes": sp.update_bytes, "bubble": free[key].bubble, "imbalance": free[key].imbalance}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro", default="2,4,8", help="micro-batch counts")
    ap.add_argument("--reps", type=int, default=7, help="timed steps per configuration (and the planner's repeats)")
    ap.add_argument("--no-docs", action="store_true", help="do not rewrite docs/BENCHMARKS.md")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "pipeline_plan.json"))
    args = ap.parse_args(argv)
    configs = [(mode, int(m)) for m in args.micro.split(",") for mode in ("1F1B", "FThenB")]
    probe = run_ranks(_probe, 2, [MICRO_ROWS * WIDTH * 4, 4 << 20], args.reps, timeout=300)[0]
    one_way = probe["one_way"]
    timed = run_ranks(_rank, 2, configs, args.reps, False, timeout=1200)
    held = run_ranks(_rank, 2, configs, args.reps, True, timeout=1200)
    rows = sorted((dict(t, **h) for tt, hh in zip(timed, held) for t, h in zip(tt, hh)),
                  key=lambda r: (r["schedule"], r["m"], r["stage"]))
    links = _links(probe)
    free, costed = predictions(configs, reps=args.reps), predictions(configs, links, args.reps)
    _compare(rows, free, costed)
    print(f"sends: {one_way[0][1] * 1e6:.0f} us one way for {one_way[0][0] >> 10} KiB (a micro-batch's activation), "
          f"{one_way[1][1] * 1e6:.0f} us for {one_way[1][0] >> 20} MiB ({links.source}); compute scale "
          f"{probe['compute_scale']:.2f} (the probe's kernel {probe['kernel_alone_s'] * 1e3:.1f} ms alone, "
          f"{probe['kernel_together_s'] * 1e3:.1f} ms on both ranks at once)")
    print(format_table(COLUMNS, rows))
    info = run_info("bench.pipeline_plan", argv)
    info["load_average"] = os.getloadavg()[0]
    _plot(rows, Path(args.out).with_suffix(".png"))
    save_json(args.out, {"info": info, "probe": probe, "links": links.source, "rows": rows})
    if not args.no_docs:
        section = (f"{SECTION}\n\n`python -m bench.pipeline_plan` ({BLOCKS} blocks Linear {WIDTH}x{WIDTH} + GELU, "
                   f"micro-batches of {MICRO_ROWS} rows, 2 stages on 2 gloo ranks, AdamW; "
                   f"{info['date']}, load average {info['load_average']:.1f} at the end). "
                   "Each ratio is the planner's figure (`fleetlike.plan.pipeline.predict_pipeline`) over the "
                   "real job's. Sends: "
                   f"{one_way[0][1] * 1e6:.0f} us one way for a micro-batch's {one_way[0][0] >> 10} KiB "
                   f"({links.source}).\n\n" + format_table(COLUMNS, rows, markdown=True)
                   + "\n\n![pipeline planner](benchmarks/pipeline_plan.png)\n")
        replace_section(ROOT / "docs" / "BENCHMARKS.md", SECTION, section)
    return 0


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Step time, activation peak and RSS peak of stage 0, measured and predicted, per schedule."""
    panels = []
    for title, measured, predicted in (("step ms", "step_ms", lambda r: r["pred_links"] * r["step_ms"]),
                                       ("activation peak MiB, stage 0", "act_mib", lambda r: r["act_ratio"] * r["act_mib"]),
                                       ("RSS peak MiB, stage 0", "rss_mib", lambda r: r["rss_ratio"] * r["rss_mib"])):
        series: dict[str, list[float]] = {}
        ratio: dict[str, list[float]] = {}
        for mode in ("1F1B", "FThenB"):
            first = [r for r in rows if r["schedule"] == mode and r["stage"] == 0]
            series[f"{mode} measured"] = [r[measured] for r in first]
            series[f"{mode} planner"] = [predicted(r) for r in first]
            ratio[mode] = [predicted(r) / r[measured] for r in first]
        panels.append({"title": title, "x": [r["m"] for r in rows if r["schedule"] == "1F1B" and r["stage"] == 0],
                       "series": series, "ratio": ratio})
    plot_panels(path, "pipeline planner / real job (2 stages, gloo)", panels, xlabel="micro-batches m", ylabel="",
                ratio_label="planner / measured", xfmt=lambda v: f"{v:.0f}")


if __name__ == "__main__":
    sys.exit(main())

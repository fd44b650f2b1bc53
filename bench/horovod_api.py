"""The Horovod face against what it sits on: ``hvd.allreduce`` vs the raw backend, and a
``hvd.DistributedOptimizer`` training step vs fleetlike's eager style and PyTorch DDP.

Two gloo ranks (``fleetlike.testing.run_ranks``), both parts side by side in one run:

1. allreduce busbw (nccl-tests' definition, 2(n-1)/n x bytes / time) from 1 MiB up, of
   ``hvd.allreduce_(t, op=hvd.Sum)`` (its agreement included: from the second call of a size
   on predicted, so carried in the data's slots, `fleetlike.horovod.speculate`), fleetlike's own
   ``world.all_reduce(t)`` (its default size check included), and the raw backend: torch's
   ``ProcessGroupGloo.allreduce`` on the same gloo group, nothing around it. Interleaved reps,
   median per size; the ratio hvd / raw has the target >= 0.95.
2. training steps/s of the ``bench.dp_vs_ddp`` models (same model, batches, SGD, 25 MB buckets),
   each framework on its own copy: ``hvd.DistributedOptimizer`` (zero_grad, backward, step),
   fleetlike's eager style (``fleet.distributed_model`` + ``fleet.distributed_optimizer``), and
   ``DistributedDataParallel`` (file rendezvous). Short timed segments (about half a second)
   alternate, rotating which goes first, for many rounds, so the machine's swings of a few
   seconds fall on every framework alike; steps/s is all rounds' steps over all rounds' time
   (the slower rank's, per round), ``paired`` the median of per-round ratios. Target hvd / DDP
   >= 1.0.

Usage (from the repository root)::

    python -m bench.horovod_api                       # 1..64 MiB, models mlp and conv
    python -m bench.horovod_api --max-size 16M --models mlp --rounds 20

Writes ``docs/benchmarks/horovod_api.json`` / ``.png`` and (re)writes the "## Horovod API"
section of ``docs/BENCHMARKS.md``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._common import (
    Column,
    format_table,
    human_bytes,
    interleaved_timings,
    median,
    parse_bytes,
    plot_panels,
    replace_section,
    run_info,
    save_json,
    size_ladder,
)
from bench.dp_vs_ddp import BUCKET_MB, MODELS, _batches, _ddp_stepper, _eager_stepper, _loss_fn, _make_model

__all__ = ["TARGET_BUSBW", "TARGET_STEP", "main"]

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2
TARGET_BUSBW = 0.95  # hvd.allreduce busbw / raw backend busbw, at least (from 1 MiB)
TARGET_STEP = 1.0  # hvd.DistributedOptimizer steps/s / DDP steps/s, at least
SECTION = "## Horovod API"
STEP_FRAMEWORKS = ("hvd", "hvd_noagree", "eager", "ddp")


# ---------------------------------------------------------------------------- worker side


def _busbw_worker(role: Any, sizes: list[int], reps: int) -> dict[str, Any]:
    import torch

    import fleetlike.horovod as hvd
    from fleetlike.fleet import fleet
    from fleetlike.horovod.runtime import runtime

    torch.set_num_threads(1)
    hvd.init(role_maker=role, timeout=300)
    try:
        world = fleet.context().world
        pg = world.process_group
        out: dict[str, Any] = {}
        for size in sizes:
            bufs = {k: torch.ones(size // 4) for k in ("hvd", "fleetlike", "raw")}
            inner = max(1, min(20, (8 << 20) // size))
            times = interleaved_timings({
                "hvd": lambda: hvd.allreduce_(bufs["hvd"], op=hvd.Sum),
                "fleetlike": lambda: world.all_reduce(bufs["fleetlike"]),
                "raw": lambda: pg.allreduce([bufs["raw"]]).wait(),
            }, reps=reps, inner=inner, sync=world.barrier, warmup=2)
            out[str(size)] = times
        spec = runtime().speculator
        out["speculation"] = {"hits": spec.hits, "misses": spec.misses}
        return out
    finally:
        hvd.shutdown()


def _hvd_stepper(name: str, data: list[dict[str, Any]], agree: bool = True) -> Any:
    import torch

    import fleetlike.horovod as hvd

    model = _make_model(name)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), agree=agree)
    i = [0]

    def step() -> None:
        opt.zero_grad()
        _loss_fn(model, data[i[0] % len(data)]).backward()
        opt.step()
        i[0] += 1

    return step


def _step_worker(role: Any, name: str, ddp_file: str, rounds: int, steps: int, warmup: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import fleetlike.horovod as hvd
    from fleetlike import DistributedStrategy

    torch.set_num_threads(1)
    s = DistributedStrategy()
    s.fuse_grad_size_in_MB = BUCKET_MB
    hvd.init(role_maker=role, strategy=s, timeout=300)
    dist.init_process_group("gloo", init_method=f"file://{ddp_file}", rank=role.rank, world_size=role.world_size)
    try:
        data = _batches(name, role.rank)
        steppers = {"hvd": _hvd_stepper(name, data), "hvd_noagree": _hvd_stepper(name, data, agree=False),
                    "eager": _eager_stepper(name, data),
                    "ddp": _ddp_stepper(name, data)}
        for fn in steppers.values():
            for _ in range(warmup):
                fn()
        rates: dict[str, list[float]] = {n: [] for n in steppers}
        names = list(steppers)
        for r in range(rounds):
            k = r % len(names)
            for n in names[k:] + names[:k]:
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(steps):
                    steppers[n]()
                rates[n].append(steps / (time.perf_counter() - t0))
        dist.barrier()
        return rates
    finally:
        dist.destroy_process_group()
        hvd.shutdown()


# ---------------------------------------------------------------------------- driver side


def measure_busbw(sizes: list[int], reps: int) -> tuple[list[dict[str, Any]], dict[str, int]]:
    from fleetlike.testing import run_ranks

    results = run_ranks(_busbw_worker, WORLD, sizes, reps, timeout=1800)
    factor = 2 * (WORLD - 1) / WORLD
    rows = []
    for size in sizes:
        # ranks run in lockstep: a rep's time is the slower rank's
        per = {k: [max(res[str(size)][k][i] for res in results) for i in range(reps)] for k in ("hvd", "fleetlike", "raw")}
        t = {k: median(v) for k, v in per.items()}
        busbw = {k: size / t[k] * factor / 1e9 for k in t}
        rows.append({"size": size, **{f"{k}_us": t[k] * 1e6 for k in t}, **{f"{k}_busbw": busbw[k] for k in t},
                     "ratio": busbw["hvd"] / busbw["raw"], "fleetlike_ratio": busbw["fleetlike"] / busbw["raw"],
                     "paired_ratio_median": median([b / a for a, b in zip(per["hvd"], per["raw"])])})
    return rows, results[0]["speculation"]


def measure_steps(name: str, rounds: int, steps: int | None) -> dict[str, Any]:
    from fleetlike.testing import run_ranks

    desc, batch, default_steps, warmup = MODELS[name]
    steps = steps or default_steps // 10
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_step_worker, WORLD, name, f"{tmp}/ddp", rounds, steps, warmup, timeout=1800)
    per_round = {fw: [min(res[fw][r] for res in results) for r in range(rounds)] for fw in STEP_FRAMEWORKS}
    # ranks run in lockstep: a round lasts as long as its slower rank; the whole run's rate
    rate = {fw: rounds * steps / sum(steps / r for r in v) for fw, v in per_round.items()}
    return {"model": name, "description": desc, "batch_per_rank": batch, "steps_per_segment": steps,
            "rounds": rounds, **{f"{fw}_steps_per_s": rate[fw] for fw in STEP_FRAMEWORKS},
            "ratio": rate["hvd"] / rate["ddp"], "hvd_vs_eager": rate["hvd"] / rate["eager"],
            "noagree_ratio": rate["hvd_noagree"] / rate["ddp"],
            "paired_ratio_median": median([a / b for a, b in zip(per_round["hvd"], per_round["ddp"])]),
            "rounds_steps_per_s": per_round}


def _tables(bw: list[dict[str, Any]], steps: list[dict[str, Any]]) -> tuple[str, str]:
    bw_table = format_table([
        Column("size", "size", human_bytes), Column("hvd_busbw", "hvd GB/s", "{:.3f}"),
        Column("fleetlike_busbw", "fleetlike GB/s", "{:.3f}"), Column("raw_busbw", "raw gloo GB/s", "{:.3f}"),
        Column("ratio", "hvd/raw", "{:.2f}"), Column("paired_ratio_median", "paired", "{:.2f}"),
        Column("fleetlike_ratio", "fleetlike/raw", "{:.2f}"),
    ], bw, markdown=True)
    step_table = format_table([
        Column("model", "model"), Column("hvd_steps_per_s", "hvd steps/s", "{:.1f}"),
        Column("hvd_noagree_steps_per_s", "hvd agree=False", "{:.1f}"),
        Column("eager_steps_per_s", "eager steps/s", "{:.1f}"), Column("ddp_steps_per_s", "DDP steps/s", "{:.1f}"),
        Column("ratio", "hvd/DDP", "{:.2f}"), Column("paired_ratio_median", "paired", "{:.2f}"),
        Column("noagree_ratio", "agree=False/DDP", "{:.2f}"), Column("hvd_vs_eager", "hvd/eager", "{:.2f}"),
    ], steps, markdown=True)
    return bw_table, step_table


def docs_section(payload: dict[str, Any]) -> str:
    """The "## Horovod API" section of docs/BENCHMARKS.md for one run's JSON payload: what it
    measures, the command, the date and load, both tables, the plot and the rounds' spread."""
    bw_table, step_table = _tables(payload["allreduce"], payload["steps"])
    load, load_after = payload["load_average_before"], payload["load_average_after"]
    machine = payload["machine"]
    spread = []
    for row in payload["steps"]:
        rounds = row["rounds_steps_per_s"]
        per = [a / b for a, b in zip(rounds["hvd"], rounds["ddp"])]
        spread.append(f"{row['model']} {min(per):.2f}-{max(per):.2f} (hvd {min(rounds['hvd']):.1f}-"
                      f"{max(rounds['hvd']):.1f} steps/s, DDP {min(rounds['ddp']):.1f}-{max(rounds['ddp']):.1f})")
    return (
        f"{SECTION}\n\n"
        "What: `hvd.allreduce_` busbw (its agreement included: none when the call is predicted) and\n"
        "fleetlike's `world.all_reduce` against torch's gloo `allreduce` on the same group; and training\n"
        "steps/s of `hvd.DistributedOptimizer` against DDP and fleetlike's eager style (the models of\n"
        f"`bench.dp_vs_ddp`, {BUCKET_MB} MB buckets, SGD). {payload['world']} gloo\n"
        "ranks. Short timed segments alternate, rotating which framework goes first, for many rounds;\n"
        "steps/s is all rounds' steps over all rounds' time (per round the slower rank's), `paired`\n"
        "the median of the per-round ratios.\n\n"
        f"    {payload['command']}\n\n"
        f"Date: {payload['date']}, {machine['cpus']} cores, torch {machine.get('torch', '?')}, load average "
        f"{load[0]:.2f} before, {load_after[0]:.2f} after (`horovod_api.json`, `horovod_api.png`).\n\n"
        f"{bw_table}\n\n{step_table}\n\n"
        "![horovod api](benchmarks/horovod_api.png)\n\n"
        f"Per-round hvd/DDP: {'; '.join(spread)}. hvd.allreduce agreements predicted on rank 0: "
        f"{payload['speculation']['hits']} hits, {payload['speculation']['misses']} misses.\n"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min-size", default="1M")
    ap.add_argument("--max-size", default="64M")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--models", default="mlp,conv")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--steps", type=int, default=None, help="steps per timed segment (default: per model)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "horovod_api.json"))
    ap.add_argument("--no-docs", action="store_true", help="do not rewrite docs/BENCHMARKS.md")
    args = ap.parse_args(argv)
    load = os.getloadavg()
    sizes = size_ladder(parse_bytes(args.min_size), parse_bytes(args.max_size))
    bw, speculation = measure_busbw(sizes, args.reps)
    models = [m for m in args.models.split(",") if m]
    steps = [measure_steps(m, args.rounds, args.steps) for m in models]
    load_after = os.getloadavg()
    bw_table, step_table = _tables(bw, steps)
    print(bw_table)
    print()
    print(step_table)
    print(f"hvd.allreduce agreements predicted (rank 0): {speculation['hits']} hits, {speculation['misses']} misses")
    info = run_info("bench.horovod_api", argv)
    payload = {**info, "world": WORLD, "load_average_before": load, "load_average_after": load_after,
               "targets": {"busbw_ratio": TARGET_BUSBW, "step_ratio": TARGET_STEP}, "allreduce": bw,
               "speculation": speculation, "steps": steps}
    out = save_json(args.out, payload)
    plot_panels(out.with_suffix(".png"), "hvd.allreduce vs raw gloo (2 ranks)", [{
        "title": "allreduce busbw",
        "x": [r["size"] for r in bw],
        "series": {"hvd.allreduce_": [r["hvd_busbw"] for r in bw], "fleetlike all_reduce": [r["fleetlike_busbw"] for r in bw],
                   "raw ProcessGroupGloo": [r["raw_busbw"] for r in bw]},
        "ratio": {"hvd / raw": [r["ratio"] for r in bw], "fleetlike / raw": [r["fleetlike_ratio"] for r in bw]},
    }], ratio_target=TARGET_BUSBW)
    print(f"wrote {out} and {out.with_suffix('.png')}")
    if not args.no_docs:
        replace_section(ROOT / "docs" / "BENCHMARKS.md", SECTION, docs_section(payload))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Optimizer-state sharding (ZeRO stage 1) against unsharded data parallel and torch's
``ZeroRedundancyOptimizer``, on gloo, side by side in one run.

Each of the ``--world`` rank processes builds the same model (``--layers`` x
``Linear(--width, --width)``, Adam) three times from one seed: fleetlike unsharded data parallel
(eager loop), fleetlike with ``strategy.sharding`` (eager loop; its update interleaved with the
parameter gather, the default), the same with ``sharding_configs.overlap_update = False``
(``sharded_serial``: the whole update, then the gather), and ``DistributedDataParallel`` +
``torch.distributed.optim.ZeroRedundancyOptimizer`` over its own gloo group (file rendezvous),
with the same bucket size (25 MB) and batches. After warm-up it
alternates timed segments of ``--steps`` steps, rotating which goes first, and reports the
median seconds per step over ``--rounds``.

Memory, per rank: the optimizer state's bytes (every tensor in ``optimizer.state``), against
the bound ``unsharded / N + the state of one largest parameter``; and the peak RSS, measured
in separate worlds (``ru_maxrss`` is a per-process high-water mark) where each rank trains with
one of the three only.

Usage (from the repository root)::

    python -m bench.sharding                          # 2 ranks, ~2 minutes
    python -m bench.sharding --world 4 --rounds 3 --no-rss
    python -m bench.sharding --out /tmp/run2 --no-docs  # a repeat: its own JSON, docs untouched

Writes ``docs/benchmarks/sharding.json`` and ``.png`` and (re)writes the "## Optimizer-state
sharding" section of ``docs/BENCHMARKS.md``.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench._common import Column, format_table, interleaved_timings, median, replace_section, run_info, save_figure, save_json

__all__ = ["TARGET_DP", "main"]

#: the targets: sharded step time <= 1.05 x unsharded data parallel, <= torch's ZeRO
TARGET_DP = 1.05
KINDS = ("dp", "sharded", "torch_zero")
#: timed side by side; peak RSS is measured for KINDS
TIMED = (*KINDS, "sharded_serial")
ROOT = Path(__file__).resolve().parent.parent


def _model(layers: int, width: int) -> Any:
    import torch

    torch.manual_seed(0)
    mods: list[Any] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods[:-1])


def _state_bytes(opt: Any) -> int:
    from fleetlike.plan.memory import optimizer_state_bytes

    return optimizer_state_bytes(opt)  # ZeroRedundancyOptimizer's: its shard's optimizer, ``optim``


def _trainers(role: Any, kinds: tuple[str, ...], args: argparse.Namespace, rdv: str) -> dict[str, Any]:
    """name -> (one-step function, optimizer) for each kind; the fleet session stays open."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    from fleetlike import DistributedStrategy, fleet

    g = torch.Generator().manual_seed(role.rank)
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randn(args.batch, args.width, generator=g)
    out: dict[str, Any] = {}
    if set(kinds) - {"torch_zero"}:
        fleet.init(role, timeout=120)
    for kind in kinds:
        model = _model(args.layers, args.width)
        if kind == "torch_zero":
            if not dist.is_initialized():
                dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=role.rank, world_size=role.world_size)
            wrapped = DistributedDataParallel(model, bucket_cap_mb=25)
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4)
        else:
            options = {"fuse_grad_size_in_MB": 25}
            if kind.startswith("sharded"):
                options.update(sharding=True, sharding_configs={"sharding_degree": 0, "segment_broadcast_MB": 25,
                                                                "overlap_update": kind == "sharded"})
            wrapped = fleet.distributed_model(model)
            opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=1e-4),
                                              DistributedStrategy.from_dict(options))

        def step(wrapped: Any = wrapped, opt: Any = opt) -> None:
            opt.zero_grad()
            F.mse_loss(wrapped(x), y).backward()
            opt.step()

        out[kind] = (step, opt, model)
    return out


def _time(role: Any, args: argparse.Namespace, rdv: str) -> dict[str, Any]:
    import torch

    from fleetlike import fleet

    trainers = _trainers(role, TIMED, args, rdv)
    world = fleet.util  # barrier between timed segments, on fleetlike's world
    sync = world.barrier
    times = interleaved_timings({k: trainers[k][0] for k in TIMED}, reps=args.rounds, inner=args.steps,
                                sync=sync, warmup=2)
    largest = max(p.numel() for p in trainers["dp"][2].parameters()) * 4
    result = {
        "times": {k: median(v) for k, v in times.items()},
        "samples": times,
        "state_bytes": {k: _state_bytes(trainers[k][1]) for k in TIMED},
        "largest_param_bytes": largest,
        "param_bytes": sum(p.numel() * 4 for p in trainers["dp"][2].parameters()),
        "applied": [str(a) for a in fleet.applied_strategy()],
    }
    del trainers
    gc.collect()
    fleet.shutdown()
    torch.distributed.destroy_process_group()
    return result


def _rss(role: Any, kind: str, args: argparse.Namespace, rdv: str) -> float:
    trainers = _trainers(role, (kind,), args, rdv)
    for _ in range(args.steps):
        trainers[kind][0]()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB (Linux: KiB)
    del trainers  # DDP and ZeroRedundancyOptimizer hang if freed after their group is destroyed
    gc.collect()
    if kind != "torch_zero":
        from fleetlike import fleet

        fleet.shutdown()
    else:
        import torch

        torch.distributed.destroy_process_group()
    return peak


def _plot(path: Path, rows: list[dict[str, Any]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["kind"] for r in rows]
    colors = ["#888", "#2a7", "#47c", "#9c7"][: len(rows)]
    a.bar(names, [r["ms"] for r in rows], color=colors)
    a.set_ylabel("ms / step (median)")
    a.set_title("step time")
    b.bar(names, [r["state_mib"] for r in rows], color=colors)
    b.set_ylabel("optimizer state per rank (MiB)")
    b.set_title("optimizer state (rank 0)")
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-rss", action="store_true")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/BENCHMARKS.md's section")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "sharding"))
    args = parser.parse_args(argv)

    from fleetlike.testing import run_ranks

    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        ranks = run_ranks(_time, args.world, args, f"{tmp}/rdv", timeout=1200)
        rss: dict[str, list[float]] = {}
        if not args.no_rss:
            for i, kind in enumerate(KINDS):
                rss[kind] = run_ranks(_rss, args.world, kind, args, f"{tmp}/rss{i}", timeout=600)
    r0 = ranks[0]
    unsharded = r0["state_bytes"]["dp"]
    bound = unsharded / args.world + 2 * r0["largest_param_bytes"]  # Adam: two moments
    rows = []
    for kind in TIMED:
        t = median([r["times"][kind] for r in ranks])
        rows.append({
            "kind": kind,
            "ms": t * 1e3,
            "vs_dp": t / median([r["times"]["dp"] for r in ranks]),
            "vs_torch": t / median([r["times"]["torch_zero"] for r in ranks]),
            "state_mib": max(r["state_bytes"][kind] for r in ranks) / (1 << 20),
            "state_ratio": max(r["state_bytes"][kind] for r in ranks) / unsharded,
            "rss_mib": max(rss[kind]) if kind in rss else None,
        })
    cols = [Column("kind", "trainer"), Column("ms", "ms/step", "{:.1f}"), Column("vs_dp", "x DP", "{:.3f}"),
            Column("vs_torch", "x torch ZeRO", "{:.3f}"), Column("state_mib", "opt state/rank MiB", "{:.1f}"),
            Column("state_ratio", "x unsharded", "{:.3f}"), Column("rss_mib", "peak RSS MiB", "{:.0f}")]
    table = format_table(cols, rows)
    sharded, serial = rows[1], rows[3]
    verdict = (f"sharded step {sharded['vs_dp']:.3f}x DP (target <= {TARGET_DP}), {sharded['vs_torch']:.3f}x "
               f"torch ZeRO (target <= 1); update then gather (overlap_update off) {serial['vs_dp']:.3f}x DP; state {sharded['state_mib']:.1f} MiB/rank vs bound "
               f"{bound / (1 << 20):.1f} MiB (1/{args.world} of {unsharded / (1 << 20):.1f} + one largest parameter's)")
    print(table)
    print(verdict)
    print(f"load average before the run: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    info = run_info("bench.sharding", argv if argv is not None else sys.argv[1:])
    model = f"{args.layers} x Linear({args.width}, {args.width}), {r0['param_bytes'] / (1 << 20):.1f} MiB, Adam, batch {args.batch}/rank"
    payload = {"info": info, "load_average": load, "world": args.world, "model": model, "rows": rows,
               "bound_bytes": bound, "unsharded_state_bytes": unsharded, "ranks": ranks, "rss": rss}
    out = Path(args.out)
    save_json(out.with_suffix(".json"), payload)
    _plot(out.with_suffix(".png"), rows, f"sharding, {args.world} ranks on gloo: {model}")
    command = "python -m bench.sharding " + " ".join(argv if argv is not None else sys.argv[1:])
    section = (
        "## Optimizer-state sharding\n\n"
        f"`{command.strip()}` ({args.world} ranks on gloo, {model}; load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} before the run; the machine is shared)\n\n"
        + format_table(cols, rows, markdown=True) + "\n\n" + verdict + ".\n\n"
        "![sharding](benchmarks/sharding.png)\n"
    )
    if not args.no_docs:
        replace_section(ROOT / "docs" / "BENCHMARKS.md", "## Optimizer-state sharding", section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

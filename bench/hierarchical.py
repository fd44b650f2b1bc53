"""Flat vs hierarchical vs hierarchical + fp16 vs hierarchical + 2 communicators, over a slow link.

Two simulated nodes x 2 workers: network namespaces joined by a veth pair limited with ``tbf``
(`bench.netns`); ranks 0-1 live in node A (10.77.0.1), ranks 2-3 in node B (10.77.0.2). All five
allreduce variants (hier_fp16_rs: hier_fp16 with the node-local hops as gloo's reduce-scatter and
allgather, the earlier form) run side by side, interleaved rep by rep, in one invocation; then a short
data-parallel training run (fleet, program style) reports steps/s for the same configurations.
Needs root (skips with the reason otherwise).

    python -m bench.hierarchical --rate 1gbit --max-size 256M
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMPLS = ("flat", "hier", "hier_fp16", "hier_2comm", "hier_fp16_rs")
TRAIN = {
    "flat": {},
    "hier": {"use_hierarchical_allreduce": True},
    "hier_fp16": {"use_hierarchical_allreduce": True, "fp16_allreduce": True},
    "hier_2comm": {"use_hierarchical_allreduce": True, "nccl_comm_num": 2},
}


def worker(rank: int, eps: list[str], eps2: list[str], sizes: list[int], reps: int, steps: int, out: str,
           segment_bytes: int = 1 << 20) -> None:
    import torch

    from bench._common import interleaved_timings, median
    from fleetlike.collectives import CompressedAllReduce, HalfCodec, HierarchicalAllReduce, hierarchical_pairs
    from fleetlike.comm import CommGroups, create_world
    from fleetlike.roles.role import Role

    torch.set_num_threads(1)
    role = Role.from_endpoints(rank, eps, job_id="bench-hier")
    world = create_world(role, backend="gloo", timeout=600)
    groups = CommGroups(world, role)
    pairs = hierarchical_pairs(groups, 2)
    hier = HierarchicalAllReduce(pairs[:1], world, segment_bytes=segment_bytes)
    hier2 = HierarchicalAllReduce(pairs, world, segment_bytes=segment_bytes)
    fp16 = CompressedAllReduce(HierarchicalAllReduce(pairs[:1], world, segment_bytes=segment_bytes), HalfCodec("float16"))
    # the same with the node-local hops as gloo's reduce-scatter + allgather (the earlier form)
    fp16_rs = CompressedAllReduce(HierarchicalAllReduce(pairs[:1], world, segment_bytes=segment_bytes, intra_form="reduce_scatter"),
                                  HalfCodec("float16"))
    rows = []
    for size in sizes:
        x = torch.randn(size // 4)
        halves = x.chunk(2)

        def two() -> None:
            works = [hier2.start_tensor(h, i, "avg") for i, h in enumerate(halves)]  # 2 buckets, 2 pairs
            for w in works:
                w.wait()

        fns = {
            "flat": lambda: world.all_reduce(x, "avg"),
            "hier": lambda: hier.start_tensor(x, 0, "avg").wait(),
            "hier_fp16": lambda: fp16.start_tensor(x, 0).wait(),
            "hier_2comm": two,
            "hier_fp16_rs": lambda: fp16_rs.start_tensor(x, 0).wait(),
        }
        r = reps if size <= (64 << 20) else max(2, reps - 1)
        cpu: dict[str, list[float]] = {k: [] for k in fns}
        t = interleaved_timings({k: _cpu_timed(fn, cpu[k]) for k, fn in fns.items()}, reps=r, sync=world.barrier)
        # CPU seconds of this process (all its threads: gloo's included) per call, the median
        # over this rank's calls: 4 ranks share 2 cores, so 2x this bounds a call from below
        rows.append({"size": size, **{k: median(v) for k, v in t.items()}, **{f"{k}_cpu": median(cpu[k]) for k in fns}})
        if rank == 0:
            print(f"  {size >> 20:>4} MiB: " + "  ".join(f"{k} {median(v) * 1e3:.0f} ms (cpu {median(cpu[k]) * 1e3:.0f})" for k, v in t.items()), flush=True)
    groups.close()

    train = {}
    if steps:
        from fleetlike import DistributedStrategy, Executor, fleet

        role2 = Role.from_endpoints(rank, eps2, job_id="bench-hier-train")
        fleet.init(role2, timeout=600)
        import torch.nn.functional as F

        for name, cfg in TRAIN.items():
            torch.manual_seed(0)
            model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])  # 32 MiB of grads
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            s = DistributedStrategy.from_dict({**cfg, "fuse_grad_size_in_MB": 8})
            fleet.distributed_optimizer(opt, s).minimize(lambda m, f: F.mse_loss(m(f["x"]), f["y"]), model)
            exe = Executor()
            exe.run(fleet.startup_program)
            feed = {"x": torch.randn(32, 1024), "y": torch.randn(32, 1024)}
            exe.run(fleet.main_program, feed=feed)  # warm up
            fleet.barrier_worker()
            t0 = time.perf_counter()
            for _ in range(steps):
                exe.run(fleet.main_program, feed=feed)
            train[name] = steps / (time.perf_counter() - t0)
            if rank == 0:
                print(f"  train {name}: {train[name]:.2f} steps/s", flush=True)
        fleet.shutdown()
    if rank == 0:
        Path(out).write_text(json.dumps({"rows": rows, "train": train}))


def _cpu_timed(fn: Callable[[], object], into: list[float]) -> Callable[[], None]:
    """``fn`` that also appends the process CPU time it took to ``into``."""

    def timed() -> None:
        c0 = time.process_time()
        fn()
        into.append(time.process_time() - c0)

    return timed


def main(argv: list[str] | None = None) -> int:
    from bench import netns
    from bench._common import Column, format_table, parse_bytes, plot_panels, run_info, save_json, size_ladder
    from fleetlike.testing import free_ports

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", default="1gbit", help="tbf rate of the inter-node link")
    ap.add_argument("--min-size", default="1M")
    ap.add_argument("--max-size", default="256M")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="training steps per configuration (0: skip)")
    ap.add_argument("--segment-size", default="1M", help="segment of the hierarchical pipeline (wire bytes)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "hierarchical"))
    args = netns.driver_args(ap, argv, worker)
    if args is None:
        return 0
    sizes = size_ladder(parse_bytes(args.min_size), parse_bytes(args.max_size))
    load = os.getloadavg()
    with netns.TwoNodes(rate=args.rate) as nodes, tempfile.TemporaryDirectory() as tmp:
        ports = free_ports(8)
        eps = [f"{netns.ADDRESSES[r // 2]}:{ports[r]}" for r in range(4)]
        eps2 = [f"{netns.ADDRESSES[r // 2]}:{ports[4 + r]}" for r in range(4)]
        result = os.path.join(tmp, "result.json")
        spec = json.dumps({"eps": eps, "eps2": eps2, "sizes": sizes, "reps": args.reps, "steps": args.steps, "out": result,
                           "segment_bytes": parse_bytes(args.segment_size)})
        tx0 = [nodes.tx_bytes(i) for i in range(2)]
        codes = nodes.run_module("bench.hierarchical", spec, 4, cwd=ROOT)
        if any(codes):
            print(f"workers failed: exit codes {codes}")
            return 1
        tx = [nodes.tx_bytes(i) - tx0[i] for i in range(2)]
        data = json.loads(Path(result).read_text())
    n = 4
    rows = []
    for r in data["rows"]:
        row = {"size": r["size"]}
        for k in IMPLS:
            row[f"{k}_ms"] = r[k] * 1e3
            row[f"{k}_busbw"] = r["size"] / r[k] * 2 * (n - 1) / n / 1e9
            row[f"{k}_cpu_ms"] = r.get(f"{k}_cpu", float("nan")) * 1e3
        row["hier/flat"] = r["flat"] / r["hier"]
        row["fp16/hier"] = r["hier"] / r["hier_fp16"]
        row["2comm/hier"] = r["hier"] / r["hier_2comm"]
        row["fp16_rs/hier"] = r["hier"] / r["hier_fp16_rs"]
        rows.append(row)
    from bench._common import human_bytes

    cols = [Column("size", "size", human_bytes)] + [Column(f"{k}_busbw", f"{k} GB/s", "{:.3f}") for k in IMPLS] + [
        Column("hier/flat", "hier/flat", "{:.2f}x"), Column("fp16/hier", "fp16/hier", "{:.2f}x"),
        Column("2comm/hier", "2comm/hier", "{:.2f}x"), Column("fp16_rs/hier", "fp16_rs/hier", "{:.2f}x")] + [
        Column(f"{k}_cpu_ms", f"{k} cpu ms", "{:.0f}") for k in ("hier", "hier_fp16", "hier_fp16_rs")]
    print(format_table(cols, rows))
    print(format_table(cols, rows, markdown=True))
    if data["train"]:
        print("training steps/s: " + ", ".join(f"{k} {v:.2f}" for k, v in data["train"].items()))
    print(f"veth tx bytes during the run: node A {tx[0]}, node B {tx[1]}")
    print("load average at the start: {:.2f} {:.2f} {:.2f}".format(*load))
    info = run_info("bench.hierarchical", argv)
    save_json(args.out + ".json", {**info, "rate": args.rate, "layout": "2 nodes x 2 ranks (netns + veth + tbf)",
                                   "rows": rows, "train_steps_per_s": data["train"], "veth_tx_bytes": tx,
                                   "loadavg_start": load})
    xs = [r["size"] for r in rows]
    plot_panels(args.out + ".png", f"allreduce, 2 nodes x 2 ranks, inter-node link tbf {args.rate}", [
        {"title": "busbw; ratio hier/flat", "x": xs, "series": {k: [r[f"{k}_busbw"] for r in rows] for k in IMPLS},
         "ratio": [r["hier/flat"] for r in rows]},
        {"title": "time (ms); ratio fp16/hier", "x": xs, "series": {k: [r[f"{k}_ms"] for r in rows] for k in IMPLS},
         "ratio": [r["fp16/hier"] for r in rows]},
    ], ratio_label="speed-up")
    return 0


if __name__ == "__main__":
    sys.exit(main())

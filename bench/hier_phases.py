"""Where a hierarchical + fp16 allreduce spends its time: each phase alone, wall and CPU.

Two simulated nodes x 2 ranks (`bench.netns`, the link of `bench.hierarchical`). Every phase of
the two-level chain over one float32 buffer runs alone, blocking, on all 4 ranks at once (so the
4 ranks share the 2 cores as in the real chain): the overflow guard's agreed maximum, the casts
(the whole buffer, or only the half a rank sends across nodes), the intra-node reduce as gloo's
reduce-scatter, as one ``reduce`` per local rank, or as the exchange of halves by two broadcasts
plus a local add, the inter-node allreduce of a rank's chunk,
the intra-node allgather or one ``broadcast`` per local rank, each in float16 and in float32.
Wall ms is rank 0's median; CPU ms is the median CPU time of rank 0's process (all threads).
Needs root.

    python -m bench.hier_phases --rate 1gbit --size 64M --reps 3
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


def worker(rank: int, eps: list[str], size: int, reps: int, out: str) -> None:
    import torch

    from bench._common import interleaved_timings, median
    from fleetlike.collectives import HalfCodec, hierarchical_pairs
    from fleetlike.collectives.segments import agree_max
    from fleetlike.comm import CommGroups, create_world
    from fleetlike.roles.role import Role

    torch.set_num_threads(1)
    role = Role.from_endpoints(rank, eps, job_id="bench-hier-phases")
    world = create_world(role, backend="gloo", timeout=600)
    groups = CommGroups(world, role)
    (intra, inter), = hierarchical_pairs(groups, 1)
    codec = HalfCodec("float16")
    n = size // 4
    x = torch.randn(n)
    bufs = {torch.float16: torch.empty(n, dtype=torch.float16), torch.float32: torch.randn(n)}
    half = n // 2

    def guard() -> None:
        codec.scales(x, lambda m: agree_max(m, intra, inter), summands=4, divide=4)

    def reduces(dt: torch.dtype) -> None:
        b = bufs[dt].view(2, -1)
        for w in [intra.reduce_async(b[j], j, "sum", agreed=True) for j in range(2)]:
            w.wait()

    def broadcasts(dt: torch.dtype) -> None:
        b = bufs[dt].view(2, -1)
        for w in [intra.broadcast_async(b[j], j, agreed=True) for j in range(2)]:
            w.wait()

    recv = {dt: torch.empty(half, dtype=dt) for dt in bufs}

    def exchange(dt: torch.dtype) -> None:
        """What segments.py's "broadcast" form does: send the peer its half, add ours."""
        b, me = bufs[dt].view(2, -1), intra.rank
        for w in [intra.broadcast_async(b[1 - me] if root == me else recv[dt], root, agreed=True) for root in range(2)]:
            w.wait()
        b[me].add_(recv[dt])

    def chunk(dt: torch.dtype) -> torch.Tensor:
        return bufs[dt].view(2, -1)[intra.rank]

    fns: dict[str, Callable[[], object]] = {
        "guard (aminmax + 2 MAX)": guard,
        "encode all": lambda: codec.encode_(x, 1.0, bufs[torch.float16]),
        "encode half": lambda: codec.encode_(x[:half], 1.0, bufs[torch.float16][:half]),
        "decode all": lambda: codec.decode_(bufs[torch.float16], 2.0, x),
        "decode half": lambda: codec.decode_(bufs[torch.float16][:half], 2.0, x[:half]),
        "intra reduce_scatter fp16": lambda: intra.reduce_scatter(bufs[torch.float16], out=chunk(torch.float16), agreed=True),
        "intra 2 reduce fp16": lambda: reduces(torch.float16),
        "intra exchange + add fp16": lambda: exchange(torch.float16),
        "intra exchange + add fp32": lambda: exchange(torch.float32),
        "intra reduce_scatter fp32": lambda: intra.reduce_scatter(bufs[torch.float32], out=chunk(torch.float32), agreed=True),
        "intra 2 reduce fp32": lambda: reduces(torch.float32),
        "inter allreduce fp16": lambda: inter.all_reduce(chunk(torch.float16), "sum", agreed=True),
        "inter allreduce fp32": lambda: inter.all_reduce(chunk(torch.float32), "sum", agreed=True),
        "intra allgather fp16": lambda: intra.all_gather_flat(chunk(torch.float16), out=bufs[torch.float16], agreed=True),
        "intra 2 broadcast fp16": lambda: broadcasts(torch.float16),
        "intra allgather fp32": lambda: intra.all_gather_flat(chunk(torch.float32), out=bufs[torch.float32], agreed=True),
        "intra 2 broadcast fp32": lambda: broadcasts(torch.float32),
    }
    cpu: dict[str, list[float]] = {k: [] for k in fns}

    def timed(k: str) -> Callable[[], None]:
        def run() -> None:
            c0 = time.process_time()
            fns[k]()
            cpu[k].append(time.process_time() - c0)
        return run

    t = interleaved_timings({k: timed(k) for k in fns}, reps=reps, sync=world.barrier)
    rows = [{"phase": k, "wall_ms": median(t[k]) * 1e3, "cpu_ms": median(cpu[k]) * 1e3} for k in fns]
    groups.close()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def main(argv: list[str] | None = None) -> int:
    from bench import netns
    from bench._common import Column, format_table, parse_bytes, run_info, save_json
    from fleetlike.testing import free_ports

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", default="1gbit", help="tbf rate of the inter-node link")
    ap.add_argument("--size", default="64M", help="float32 buffer size")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "hier_phases"))
    args = netns.driver_args(ap, argv, worker)
    if args is None:
        return 0
    load = os.getloadavg()
    with netns.TwoNodes(rate=args.rate) as nodes, tempfile.TemporaryDirectory() as tmp:
        ports = free_ports(4)
        eps = [f"{netns.ADDRESSES[r // 2]}:{ports[r]}" for r in range(4)]
        result = os.path.join(tmp, "result.json")
        spec = json.dumps({"eps": eps, "size": parse_bytes(args.size), "reps": args.reps, "out": result})
        codes = nodes.run_module("bench.hier_phases", spec, 4, cwd=ROOT)
        if any(codes):
            print(f"workers failed: exit codes {codes}")
            return 1
        rows = json.loads(Path(result).read_text())
    cols = [Column("phase", "phase", "{}"), Column("wall_ms", "wall ms", "{:.1f}"), Column("cpu_ms", "cpu ms", "{:.1f}")]
    print(format_table(cols, rows))
    print(format_table(cols, rows, markdown=True))
    print(f"load average at the start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    save_json(args.out + ".json", {**run_info("bench.hier_phases", argv), "rate": args.rate, "size": args.size,
                                   "layout": "2 nodes x 2 ranks (netns + veth + tbf)", "loadavg_start": load, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())

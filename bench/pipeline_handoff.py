"""Where a pipeline's stage-to-stage handoff goes: the same bytes between two ranks of one host
over gloo (torch's process group, what the stages' sends rode), a raw loopback TCP socket and
fleetlike's shared-memory backend (`fleetlike.comm.torch_shm`, through torch's ``isend`` /
``irecv`` as a pipeline stage calls them).

Each rank runs on a core of its own (``--pin``, the default where the job may use 2 CPUs;
gloo's threads with it), one intra-op thread. Per message size (the bench pipeline's
activation is 16 x 1024 float32 = 64 KiB): a ping-pong (rank 0 sends, rank 1 receives and
sends back) timed ``--inner`` times per sample, ``--reps`` samples per transport, the
transports interleaved sample by sample; one way = half the round trip. And what posting a
send costs the sender (``isend`` returning, before any wait), the part a schedule pays before
its next forward.

Usage (from the repository root)::

    python -m bench.pipeline_handoff                  # ~20 s
    python -m bench.pipeline_handoff --sizes 64K,1M,4M --out /tmp/h.json

Writes ``docs/benchmarks/pipeline_handoff.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench._common import format_table, interleaved_timings, median, parse_bytes, run_info, save_json

from bench.pipeline_report import HANDOFF_COLUMNS

__all__ = ["main"]

ROOT = Path(__file__).resolve().parents[1]

def _socket_pair(rank: int, pg: Any) -> socket.socket:
    """A connected loopback TCP socket between the 2 ranks (the port travels on ``pg``)."""
    import torch.distributed as dist

    port = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port[0] = server.getsockname()[1]
        dist.broadcast(port, group_src=0, group=pg)
        conn, _ = server.accept()
        server.close()
    else:
        dist.broadcast(port, group_src=0, group=pg)
        conn = socket.create_connection(("127.0.0.1", int(port[0])))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def _recv_exact(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        got += conn.recv_into(view[got:])


def _rank(role: Any, sizes: list[int], reps: int, inner: int, pin: bool) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from bench.pipeline import pin_to_core
    from fleetlike.comm.torch_shm import BACKEND, register
    from fleetlike.comm.torch_group import torch_process_group
    from fleetlike.comm import create_world

    pin_to_core(role.rank if pin else None)
    world = create_world(role)
    torch_process_group(world, torch.device("cpu"), purpose="the handoff benchmark")
    register()
    gloo = dist.new_group([0, 1])
    shm = dist.new_group([0, 1], backend=BACKEND)
    if 1 - role.rank not in shm.local:
        raise RuntimeError(f"the 2 ranks share no memory here ({shm!r}): nothing to compare")
    conn = _socket_pair(role.rank, gloo)
    me, other = role.rank, 1 - role.rank
    rows = []
    for nbytes in sizes:
        buf = torch.zeros(nbytes // 4)
        raw = memoryview(buf.numpy()).cast("B")

        def over(pg: Any) -> Any:
            def ping_pong() -> None:
                if me == 0:
                    dist.isend(buf, group=pg, group_dst=other).wait()
                    dist.irecv(buf, group=pg, group_src=other).wait()
                else:
                    dist.irecv(buf, group=pg, group_src=other).wait()
                    dist.isend(buf, group=pg, group_dst=other).wait()
            return ping_pong

        def tcp() -> None:
            if me == 0:
                conn.sendall(raw)
                _recv_exact(conn, raw)
            else:
                _recv_exact(conn, raw)
                conn.sendall(raw)

        times = interleaved_timings({"gloo": over(gloo), "tcp": tcp, "shm": over(shm)}, reps=reps, inner=inner,
                                    sync=lambda: dist.barrier(group=gloo), warmup=3)
        post = {}
        for name, pg in (("gloo", gloo), ("shm", shm)):
            samples = []
            for _ in range(reps):
                dist.barrier(group=gloo)
                if me == 0:
                    t0 = time.perf_counter()
                    work = dist.isend(buf, group=pg, group_dst=other)
                    samples.append(time.perf_counter() - t0)
                    work.wait()
                else:
                    dist.irecv(buf, group=pg, group_src=other).wait()
            post[name] = median(samples) if samples else float("nan")
        rows.append({"bytes": nbytes, **{f"{k}_us": median(v) / 2 * 1e6 for k, v in times.items()},
                     "gloo_over_shm": median(times["gloo"]) / median(times["shm"]),
                     "gloo_post_us": post["gloo"] * 1e6, "shm_post_us": post["shm"] * 1e6})
    conn.close()
    dist.barrier(group=gloo)
    from fleetlike.comm.torch_group import release_torch_group

    release_torch_group(world)
    world.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64K,1M", help="message sizes")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--inner", type=int, default=20, help="ping-pongs per sample")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=None,
                    help="each rank on its own core; default: on where this process may use 2 CPUs")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "pipeline_handoff.json"))
    args = ap.parse_args(argv)
    from fleetlike.testing import run_ranks

    pin = len(os.sched_getaffinity(0)) >= 2 if args.pin is None else args.pin
    sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    rows = run_ranks(_rank, 2, sizes, args.reps, args.inner, pin, timeout=600)[0]
    print(format_table(HANDOFF_COLUMNS, rows))
    save_json(Path(args.out), {"info": run_info("bench.pipeline_handoff", argv), "pinned": pin,
                               "load_end": os.getloadavg()[0], "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())

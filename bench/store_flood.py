"""The job's store under a stranger's flood, and what its bounds cost: torch's own server against
fleetlike's bounded one (`fleetlike.comm.store_server`), side by side.

For each server, in a fresh process of its own (``MALLOC_MMAP_THRESHOLD_=131072``, as every
memory figure of this project): the time to host it (bind, start, the host's own client
connected), the time of a small ``set`` + ``get`` round trip from a client, then a stranger's
flood (``--values`` raw ``set`` requests of ``--mib`` MiB each, one connection each, as
anyone who can reach the port could send) and the resident memory the store's host process(es)
gained, with how many of the values were accepted.

Usage (from the repository root)::

    python -m bench.store_flood --values 150 --mib 7

Prints the table, writes ``docs/benchmarks/store_flood.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from bench._common import Column, format_table, run_info, save_figure, save_json

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "benchmarks" / "store_flood.json"
KINDS = ("torch", "bounded")


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _host(kind: str) -> tuple[Any, Any, list[int]]:
    import torch.distributed as dist

    from fleetlike.comm.store_server import StoreServer

    td = datetime.timedelta(seconds=30)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    port = sock.getsockname()[1]
    if kind == "torch":
        store = dist.TCPStore("127.0.0.1", port, None, True, td, wait_for_workers=False,
                              master_listen_fd=sock.detach())
        return store, None, [os.getpid()]
    server = StoreServer.start(sock.detach())
    return dist.TCPStore("127.0.0.1", port, None, False, td), server, [os.getpid(), server.pid]


def _flood(port: int, values: int, mib: int) -> int:
    value = b"x" * (mib << 20)
    accepted = 0
    for i in range(values):
        key = b"/flood%d" % i
        frame = (b"\x00" + struct.pack("<I", 0x3C85F7CE) + b"\x01" + struct.pack("<Q", len(key)) + key
                 + struct.pack("<Q", len(value)) + value + b"\x07")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
                s.sendall(frame)
                accepted += len(s.recv(8)) == 8
        except OSError:
            pass
    return accepted


def _worker(kind: str, values: int, mib: int) -> dict[str, Any]:
    import torch.distributed as dist

    starts = []
    for _ in range(9):
        t0 = time.perf_counter()
        store, server, _ = _host(kind)
        starts.append(time.perf_counter() - t0)
        del store
        if server is not None:
            server.close()
    store, server, pids = _host(kind)
    client = dist.TCPStore("127.0.0.1", store.port, None, False, datetime.timedelta(seconds=30))
    trips = []
    for i in range(2000):
        t0 = time.perf_counter()
        client.set("k", str(i))
        client.get("k")
        trips.append(time.perf_counter() - t0)
    time.sleep(0.2)
    before = sum(_rss_kib(p) for p in pids)
    accepted = _flood(store.port, values, mib)
    time.sleep(0.5)
    after = sum(_rss_kib(p) for p in pids)
    ok = client.get("k") == b"1999"
    if server is not None:
        server.close()
    return {"kind": kind, "start_ms": statistics.median(starts) * 1e3,
            "roundtrip_us": statistics.median(trips) * 1e6, "accepted": accepted, "offered": values,
            "rss_before_mib": before / 1024, "rss_after_mib": after / 1024,
            "grown_mib": (after - before) / 1024, "member_ok": ok}


def run_worker(module: str, kind: str, args: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """``python -m module --worker kind *args`` in a fresh process: the JSON its last line prints."""
    done = subprocess.run([sys.executable, "-m", module, "--worker", kind, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{module}: the {kind} worker failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse_or_serve(ap: argparse.ArgumentParser, argv: list[str] | None, out: Path,
                   worker: Callable[[argparse.Namespace], dict[str, Any]]) -> argparse.Namespace | None:
    """The bench's arguments (with ``--out`` and the hidden ``--worker``), or None once this
    process was a worker and printed its row."""
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(out))
    args = ap.parse_args(argv)
    if args.worker is None:
        return args
    print(json.dumps(worker(args)))
    return None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--values", type=int, default=150)
    ap.add_argument("--mib", type=int, default=7)
    args = parse_or_serve(ap, argv, OUT, lambda a: _worker(a.worker, a.values, a.mib))
    if args is None:
        return
    rows = []
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    for kind in KINDS:
        rows.append(run_worker("bench.store_flood", kind, ["--values", str(args.values), "--mib", str(args.mib)], env))
    columns = [Column("kind", "server"), Column("start_ms", "host it (ms)", "{:.1f}"),
               Column("roundtrip_us", "set+get (us)", "{:.0f}"),
               Column("accepted", f"of {args.values} x {args.mib} MiB accepted", "{}"),
               Column("rss_before_mib", "RSS before (MiB)", "{:.0f}"),
               Column("grown_mib", "RSS grown (MiB)", "{:.0f}"), Column("member_ok", "member unharmed", "{}")]
    print(format_table(columns, rows))
    save_json(args.out, {"run": run_info("bench.store_flood", argv), "values": args.values,
                         "mib": args.mib, "rows": rows})
    _plot(rows, args, Path(args.out).with_suffix(".png"))


def _plot(rows: list[dict[str, Any]], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    fig, (grown, taken) = pyplot.subplots(1, 2, figsize=(8, 3.2))
    names = [r["kind"] for r in rows]
    grown.bar(names, [r["grown_mib"] for r in rows], color="tab:red")
    grown.set_ylabel("host RSS grown (MiB)")
    taken.bar(names, [r["accepted"] for r in rows], color="tab:blue")
    taken.set_ylabel(f"values accepted of {args.values} x {args.mib} MiB")
    save_figure(fig, path)

if __name__ == "__main__":
    main()

"""How fast the job's store answers a launcher's heartbeat look, idle and on a busy machine:
torch's own server against fleetlike's bounded one (`fleetlike.comm.store_server`), side by side.

An elastic launcher that hosts the rendezvous store also heartbeats on it and reads the other
launchers' beats every second (`fleetlike.launch.nodewatch`: a ``set``, an ``add`` and two
``multi_get``), from its own process: torch's server answers from a thread of that process,
the bounded one from a process of its own, which the machine's scheduler must run for every
request. For each server and each load (``--loads``: that many busy-looping processes beside
it, on a machine that has fewer cores than that), in a fresh process: ``--looks`` such looks,
``--interval`` seconds apart (a launcher sleeps between its looks, so each one finds the
server asleep), each timed from its first request to its last answer; the table shows the
median, the 99th percentile and the slowest.

Usage (from the repository root)::

    python -m bench.store_latency --looks 300 --interval 0.02 --loads 0,4

Prints the table, writes ``docs/benchmarks/store_latency.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench._common import Column, format_table, run_info, save_figure, save_json
from bench.store_flood import KINDS, _host, parse_or_serve, run_worker

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "benchmarks" / "store_latency.json"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _worker(kind: str, looks: int, interval: float) -> dict[str, Any]:
    import torch.distributed as dist

    store, server, _ = _host(kind)
    other = dist.TCPStore("127.0.0.1", store.port, None, False, datetime.timedelta(seconds=30))
    other.set("beat/127.0.0.2", "0 up")
    store.set("nodes/1", "127.0.0.1")
    store.set("nodes/2", "127.0.0.2")
    store.add("nodes", 2)
    times = []
    for i in range(looks):
        time.sleep(interval)
        t0 = time.perf_counter()
        store.set("beat/127.0.0.1", f"{i} up")  # the look of `NodeWatch.run` and `_look`
        count = int(store.add("nodes", 0))
        ips = sorted(v.decode() for v in store.multi_get([f"nodes/{n}" for n in range(1, count + 1)]))
        store.multi_get([f"beat/{ip}" for ip in ips if ip != "127.0.0.1"])
        times.append(time.perf_counter() - t0)
    if server is not None:
        server.close()
    return {"kind": kind, "looks": looks, "p50_us": _percentile(times, 0.5) * 1e6,
            "p99_us": _percentile(times, 0.99) * 1e6, "max_ms": max(times) * 1e3}


def _busy(n: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--looks", type=int, default=300)
    ap.add_argument("--interval", type=float, default=0.02)
    ap.add_argument("--loads", default="0,4", help="comma-separated counts of busy processes")
    args = parse_or_serve(ap, argv, OUT, lambda a: _worker(a.worker, a.looks, a.interval))
    if args is None:
        return
    rows = []
    for load in (int(n) for n in args.loads.split(",")):
        for kind in KINDS:
            busy = _busy(load)
            try:
                row = run_worker("bench.store_latency", kind, ["--looks", str(args.looks),
                                                               "--interval", str(args.interval)])
            finally:
                for proc in busy:
                    proc.kill()
                    proc.wait()
            rows.append({"load": load, **row})
    columns = [Column("kind", "server"), Column("load", "busy processes", "{}"),
               Column("p50_us", "look p50 (us)", "{:.0f}"), Column("p99_us", "look p99 (us)", "{:.0f}"),
               Column("max_ms", "slowest (ms)", "{:.1f}")]
    print(format_table(columns, rows))
    save_json(args.out, {"run": run_info("bench.store_latency", argv), "cpus": len(os.sched_getaffinity(0)),
                         "looks": args.looks, "interval": args.interval, "rows": rows})
    _plot(rows, Path(args.out).with_suffix(".png"))


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    fig, ax = pyplot.subplots(figsize=(6, 3.2))
    loads = sorted({r["load"] for r in rows})
    width = 0.8 / len(KINDS)
    for i, kind in enumerate(KINDS):
        mine = {r["load"]: r for r in rows if r["kind"] == kind}
        ax.bar([x + i * width for x in range(len(loads))], [mine[n]["p99_us"] / 1e3 for n in loads],
               width, label=f"{kind} p99")
    ax.set_xticks([x + width * (len(KINDS) - 1) / 2 for x in range(len(loads))])
    ax.set_xticklabels([f"{n} busy" for n in loads])
    ax.set_ylabel("heartbeat look (ms)")
    ax.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    main()

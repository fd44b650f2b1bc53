"""What the job secret's handshake costs at start: a world's rendezvous, timed on two trees.

Every rank of a world times its own ``make_world(role)`` (the rendezvous on the store, the
admission by rank 0 where the tree has one, then gloo's connections) from the moment it starts
it; a round's figure is the slowest rank's, plus the time the starting process took to host the
store beforehand (as a launcher does before its workers start). ``--base REV`` (a git revision, its ``fleetlike/``
extracted to a temporary folder) and the working tree take turns round by round, each round in a
fresh process of its own, so both see the same machine. Per step nothing changes: the handshake
runs once, when the world forms; the collectives after it are the same calls.

``--servers torch,bounded`` compares the store's servers instead (``FLEETLIKE_STORE_SERVER``, on
the working tree, round by round in turn), and adds what a launcher does before its workers
start: hosting the store (its port, its server, its greeting). The start a server changes is the
hosting plus the slowest rank's rendezvous.

Usage (from the repository root)::

    python -m bench.rendezvous_start --base 2f9e186 --rounds 7 --worlds 2,4
    python -m bench.rendezvous_start --servers torch,bounded --rounds 9 --worlds 2

Prints the table, writes ``docs/benchmarks/rendezvous_start.json`` (``rendezvous_start_servers``
with ``--servers``) and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._common import Column, format_table, run_info, save_figure, save_json

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "benchmarks" / "rendezvous_start.json"


def _rank(role: Any) -> float:
    from fleetlike.testing import make_world

    t0 = time.perf_counter()
    world = make_world(role, backend="gloo")
    took = time.perf_counter() - t0
    world.barrier()
    return took


def _worker(world: int) -> None:
    from fleetlike.testing import run_ranks

    try:
        from fleetlike.testing import hosted_job
    except ImportError:  # a base tree from before it: its ranks alone are timed
        print(json.dumps({"host": 0.0, "world": max(run_ranks(_rank, world, timeout=120))}))
        return
    t0 = time.perf_counter()
    job = hosted_job(1, world, job_id="bench")  # what the launcher does before its workers start
    hosting = time.perf_counter() - t0
    try:
        print(json.dumps({"host": hosting, "world": max(run_ranks(_rank, job=job, timeout=120))}))
    finally:
        job.close()


def _extract(rev: str, into: Path) -> Path:
    archive = into / "base.tar"
    subprocess.run(["git", "archive", "-o", str(archive), rev, "fleetlike"], cwd=ROOT, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into / "tree", filter="data")
    return into / "tree"


def _one(tree: Path, world: int, **env_extra: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{ROOT}", **env_extra)
    done = subprocess.run([sys.executable, "-m", "bench.rendezvous_start", "--worker", str(world)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=180, check=False)
    if done.returncode != 0:
        raise SystemExit(f"bench.rendezvous_start: a {world}-rank world of {tree} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _servers(args: argparse.Namespace, argv: list[str] | None) -> None:
    """``--servers``: the same tree under each store server, in turn every round."""
    servers = args.servers.split(",")
    out = Path(args.out if args.out != str(OUT) else OUT.with_name("rendezvous_start_servers.json"))
    rows = []
    for world in (int(w) for w in args.worlds.split(",")):
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
        for _ in range(args.rounds):
            for name in servers:
                runs[name].append(_one(ROOT, world, FLEETLIKE_STORE_SERVER=name))
        for name in servers:
            host = [r["host"] for r in runs[name]]
            meet = [r["world"] for r in runs[name]]
            total = [r["host"] + r["world"] for r in runs[name]]
            rows.append({"world": world, "server": name, "host_ms": statistics.median(host) * 1e3,
                         "world_ms": statistics.median(meet) * 1e3, "total_ms": statistics.median(total) * 1e3,
                         "runs": runs[name]})
        first = next(r for r in rows if r["world"] == world and r["server"] == servers[0])
        for row in rows:
            if row["world"] == world:
                row["added_ms"] = row["total_ms"] - first["total_ms"]
    columns = [Column("world", "world", "{}"), Column("server", "server", "{}"),
               Column("host_ms", "hosting ms", "{:.1f}"), Column("world_ms", "make_world ms", "{:.1f}"),
               Column("total_ms", "start ms", "{:.1f}"), Column("added_ms", f"vs {servers[0]} ms", "{:+.1f}")]
    print(format_table(columns, rows))
    save_json(str(out), {"run": run_info("bench.rendezvous_start", argv), "rounds": args.rounds,
                         "note": "medians; start = hosting + the slowest rank's make_world", "rows": rows})
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    labels = [f"{r['server']}, {r['world']} ranks" for r in rows]
    ax.bar(labels, [r["host_ms"] for r in rows], label="hosting the store")
    ax.bar(labels, [r["world_ms"] for r in rows], bottom=[r["host_ms"] for r in rows],
           label="make_world, slowest rank")
    ax.set_ylabel("ms (median)")
    ax.legend()
    save_figure(fig, out.with_suffix(".png"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="2f9e186", help="git revision to compare against")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--servers", default=None,
                    help="compare FLEETLIKE_STORE_SERVER values (torch,bounded) instead of trees")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    if args.worker is not None:
        _worker(args.worker)
        return
    if args.servers:
        _servers(args, argv)
        return
    worlds = [int(w) for w in args.worlds.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"base": _extract(args.base, Path(tmp)), "this tree": ROOT}
        for world in worlds:
            seconds: dict[str, list[float]] = {name: [] for name in trees}
            for _ in range(args.rounds):
                for name, tree in trees.items():
                    run = _one(tree, world)  # hosting the store (where the tree has hosted_job) + rendezvous
                    seconds[name].append(run["host"] + run["world"])
            base, new = statistics.median(seconds["base"]), statistics.median(seconds["this tree"])
            rows.append({"world": world, "base_ms": base * 1e3, "new_ms": new * 1e3,
                         "added_ms": (new - base) * 1e3, "base_all": seconds["base"],
                         "new_all": seconds["this tree"]})
    columns = [Column("world", "world", "{}"), Column("base_ms", f"{args.base} ms (median)", "{:.1f}"),
               Column("new_ms", "this tree ms (median)", "{:.1f}"), Column("added_ms", "added ms", "{:+.1f}")]
    print(format_table(columns, rows))
    save_json(args.out, {"run": run_info("bench.rendezvous_start", argv), "base": args.base,
                         "rounds": args.rounds, "rows": rows})
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["base_ms"] for r in rows], 0.4, label=args.base)
    ax.bar([x + 0.2 for x in xs], [r["new_ms"] for r in rows], 0.4, label="with the job secret")
    ax.set_xticks(list(xs), [f"{r['world']} ranks" for r in rows])
    ax.set_ylabel("make_world, slowest rank (ms)")
    ax.legend()
    save_figure(fig, Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()

"""An unmodified DDP script over a slow link: plain DDP vs ``import fleetlike.auto`` with env knobs.

Two simulated nodes x 2 ranks (`bench.netns`: network namespaces, a veth pair limited by ``tbf``,
1 Gbit by default). Every configuration runs examples/ddp/main.py, the same imagenet-shaped DDP
script, started as torchrun would start it (RANK, WORLD_SIZE, LOCAL_RANK, GROUP_RANK,
MASTER_ADDR/PORT; torch's own gloo group on the veth's address):

* ``plain``: main.py as it is, torch DDP's own allreduce;
* ``hier_fp16``: examples/ddp/accelerated.py (main.py + ``import fleetlike.auto``) with
  ``FLEETLIKE_ALLREDUCE_MODE=hierarchical FLEETLIKE_ALLREDUCE_DTYPE=fp16``;
* ``hier_fp16_gossip4``: the same plus ``FLEETLIKE_DOWNSAMPLE_N_ELEMENTS=4``;
* ``hier_fp16_guard0`` / ``hier_fp16_guard1``: hier_fp16 with the divergence guard's period
  ``FLEETLIKE_DIVERGENCE_CHECK_N_STEPS`` 0 (only the check when DDP wraps the model) and 1 (a
  check every backward pass): their difference is the cost of one check, and that over the
  default period (200) and a step is the guard's share of a step (``--configs`` picks them).

The configurations alternate rep by rep in one invocation; steps/s is the script's own figure
(rank 0's ``done: N steps in Xs``; the same number of steps everywhere); ratios are each
configuration over the first one. Needs root.

    python -m bench.ddp_hooks --rate 1gbit --reps 3
    python -m bench.ddp_hooks --reps 2 --configs plain,hier_fp16,hier_fp16_guard0,hier_fp16_guard1
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from fleetlike.collectives.divergence import DEFAULT_EVERY
from fleetlike.config.envvars import DIVERGENCE_CHECK_N_STEPS

ROOT = Path(__file__).resolve().parent.parent
MAIN = ROOT / "examples" / "ddp" / "main.py"
AUTO = ROOT / "examples" / "ddp" / "accelerated.py"
_HIER_FP16 = {"FLEETLIKE_ALLREDUCE_MODE": "hierarchical", "FLEETLIKE_ALLREDUCE_DTYPE": "fp16"}
CONFIGS: dict[str, tuple[Path, dict[str, str]]] = {
    "plain": (MAIN, {}),
    "hier_fp16": (AUTO, _HIER_FP16),
    "hier_fp16_gossip4": (AUTO, {**_HIER_FP16, "FLEETLIKE_DOWNSAMPLE_N_ELEMENTS": "4"}),
    "hier_fp16_guard0": (AUTO, {**_HIER_FP16, DIVERGENCE_CHECK_N_STEPS: "0"}),
    "hier_fp16_guard1": (AUTO, {**_HIER_FP16, DIVERGENCE_CHECK_N_STEPS: "1"}),
}
DEFAULT_CONFIGS = ("plain", "hier_fp16", "hier_fp16_gossip4")
_DONE = re.compile(r"done: (\d+) steps in ([0-9.]+)s")


def _read(proc: subprocess.Popen, outs: list[str], i: int) -> None:
    assert proc.stdout is not None
    outs[i] = proc.stdout.read()


def _run(nodes, name: str, script_args: list[str], port: int) -> tuple[int, float]:
    from bench import netns

    script, knobs = CONFIGS[name]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("FLEETLIKE_", "PADDLE_", "TORCHELASTIC"))}
    procs = []
    job = f"bench-ddp-{uuid.uuid4().hex[:8]}"  # one job id for the 4 ranks of this run
    for rank in range(4):
        node = rank // 2
        env = {**base, **knobs, "RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(rank % 2),
               "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(node), "MASTER_ADDR": netns.ADDRESSES[0],
               "MASTER_PORT": str(port), "FLEETLIKE_NODE_IPS": ",".join(netns.ADDRESSES),
               "FLEETLIKE_JOB_ID": job, "GLOO_SOCKET_IFNAME": nodes.dev[node],
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        procs.append(nodes.popen(node, [sys.executable, str(script), *script_args, "--checkpoint", os.devnull],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT))
    outs = [""] * 4
    readers = [threading.Thread(target=_read, args=(p, outs, i), daemon=True) for i, p in enumerate(procs)]
    for t in readers:
        t.start()
    deadline = time.monotonic() + 900
    try:  # a rank that fails ends the run at once (the others would wait for it until their timeout)
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for t in readers:
            t.join(timeout=10)
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{name}: exit codes {[p.returncode for p in procs]}\n" + "\n".join(outs))
    m = _DONE.search(outs[0])
    if m is None:
        raise RuntimeError(f"{name}: rank 0 printed no 'done:' line\n{outs[0]}")
    return int(m.group(1)), int(m.group(1)) / float(m.group(2))


def main(argv: list[str] | None = None) -> int:
    from bench import netns
    from bench._common import Column, format_table, median, plot_panels, run_info, save_json
    from fleetlike.testing import free_ports

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", default="1gbit", help="tbf rate of the inter-node link")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--width", type=int, default=64, help="ResNet width: 64 is resnet18's (11M parameters, 45 MB of gradients)")
    ap.add_argument("--samples", type=int, default=160, help="synthetic images: steps = samples / (4 x batch)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--image-size", type=int, default=8, help="small images: the gradients, not the compute, dominate")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "ddp_hooks"))
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    args = ap.parse_args(argv)
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in names if c not in CONFIGS]
    if bad or not names:
        ap.error(f"--configs: {', '.join(bad) or 'none given'}; choose from {', '.join(CONFIGS)}")
    why = netns.unavailable()
    if why:
        print(f"SKIPPED: {why}")
        return 0
    script_args = ["--width", str(args.width), "--samples", str(args.samples), "--batch-size", str(args.batch_size),
                   "--print-freq", "1000", "--image-size", str(args.image_size)]
    runs: dict[str, list[float]] = {k: [] for k in names}
    steps: dict[str, int] = {}
    with netns.TwoNodes(rate=args.rate) as nodes:
        for rep in range(args.reps):
            for name in names:
                n, rate = _run(nodes, name, script_args, free_ports(1)[0])
                steps[name] = n
                runs[name].append(rate)
                print(f"  rep {rep}: {name:>18} {rate:.3f} steps/s ({n} steps)", flush=True)
    if len(set(steps.values())) != 1:
        raise RuntimeError(f"unequal step counts {steps}")
    first, others = names[0], names[1:]
    rows = []
    for rep in range(args.reps):
        rows.append({"rep": rep, **{k: runs[k][rep] for k in names},
                     **{f"{k}/{first}": runs[k][rep] / runs[first][rep] for k in others}})
    med = {k: median(v) for k, v in runs.items()}
    rows.append({"rep": "median", **med, **{f"{k}/{first}": med[k] / med[first] for k in others}})
    cols = [Column("rep", "rep", "{}")] + [Column(k, f"{k} steps/s", "{:.3f}") for k in names] + [
        Column(f"{k}/{first}", f"{k}/{first}", "{:.2f}x") for k in others]
    print(format_table(cols, rows))
    print(format_table(cols, rows, markdown=True))
    guard = _guard_cost(med) if {"hier_fp16_guard0", "hier_fp16_guard1"} <= set(names) else None
    if guard:
        print(f"divergence guard (DDP face): {guard['check_ms']:.1f} ms a check; at N={guard['every']} "
              f"{guard['share_pct']:.3f}% of a step")
    load = os.getloadavg()
    print(f"load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    info = run_info("bench.ddp_hooks", argv)
    save_json(args.out + ".json", {**info, "rate": args.rate, "layout": "2 nodes x 2 ranks (netns + veth + tbf)",
                                   "script_args": script_args, "steps": steps, "rows": rows, "loadavg": load,
                                   "guard": guard})
    reps = list(range(1, args.reps + 1))
    plot_panels(args.out + ".png", f"examples/ddp/main.py, 2 nodes x 2 ranks, link tbf {args.rate}", [
        {"title": f"steps/s per rep; ratio over {first}", "x": reps, "series": {k: runs[k] for k in names},
         "ratio": {f"{k}/{first}": [r[f"{k}/{first}"] for r in rows[:-1]] for k in others}},
    ], xlabel="rep", ylabel="steps/s", ratio_label="ratio", xfmt=lambda v: f"{int(v)}")
    return 0


def _guard_cost(med: dict[str, float]) -> dict[str, float]:
    """The divergence guard's cost from the medians: a check is the step time with a check every
    pass minus the step time without; its share of a step at the default period."""
    off, every_pass = med["hier_fp16_guard0"], med["hier_fp16_guard1"]
    check_s = 1.0 / every_pass - 1.0 / off
    return {"every": DEFAULT_EVERY, "check_ms": 1e3 * check_s, "share_pct": 100.0 * check_s * off / DEFAULT_EVERY,
            "on_default_vs_off": med["hier_fp16"] / off if "hier_fp16" in med else float("nan")}


if __name__ == "__main__":
    sys.exit(main())

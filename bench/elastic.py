"""Elastic jobs: how fast a lost node is survived, how much work is lost, what commit() costs.

Two measurements from one run (``python -m bench.elastic``):

1. Recovery, with real launchers on two loopback nodes (127.0.0.1, 127.0.0.2; 2 workers each,
   ``--nnodes 1:2``, the digits job of tests/launch_workers/elastic_digits.py, a commit every 5
   steps, the default ``--rdzv_last_call`` of 3 s): once the 4-rank world trains, node 2's
   launcher is SIGKILLed (its workers die with it). Reported: seconds from the kill to the next
   completed step on the remaining node (target <= 10 s), and the steps lost (the step counter
   at the kill minus the commit the survivors resumed from; target <= the steps since the last
   commit, by construction <= 5 here).
2. The cost of ``TorchState.commit()`` for a 50 MB model (three 2048x2048 layers, SGD with
   momentum: 50 MB of parameters plus 50 MB of optimizer state copied) next to one
   data-parallel training step of the same model on 2 gloo ranks; with a commit every 10
   steps the overhead per step is commit / 10 / step (target <= 5 %).

Writes docs/benchmarks/elastic.json and elastic.png.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench._common import Column, format_table, median, run_info, save_json
from fleetlike.testing import run_ranks

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "launch_workers" / "elastic_digits.py"
OUT = ROOT / "docs" / "benchmarks"
COMMIT_EVERY_STEPS = 5  # the digits job's cadence


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launcher(port: int, ip: str, out: Path, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "fleetlike.launch", "--nnodes=1:2", f"--rdzv_endpoint=127.0.0.1:{port}",
           f"--node_ip={ip}", "--nproc_per_node=2", "--started_port=auto", f"--log_dir={log}",
           str(SCRIPT), str(out), "3", "0.02", "eager"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(cmd, cwd=out, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _progress(out: Path) -> tuple[int, int, float]:
    try:
        step, world, stamp = (out / "progress").read_text().split()
        return int(step), int(world), float(stamp)
    except (OSError, ValueError):
        return 0, 0, 0.0


def _wait(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"bench.elastic: {what} did not happen within {timeout}s")
        time.sleep(0.01)


def recovery_trial(tmp: Path) -> dict[str, Any]:
    """One node loss; see the module docstring."""
    out = tmp / f"trial-{time.monotonic_ns()}"
    out.mkdir()
    port = _free_port()
    procs = [_launcher(port, ip, out, out / f"log-{ip}") for ip in ("127.0.0.1", "127.0.0.2")]
    try:
        _wait(lambda: _progress(out)[1] == 4, 120, "the 4-rank world")
        first = _progress(out)[0]
        _wait(lambda: _progress(out)[0] >= first + 7, 60, "steps on 4 ranks")
        at_kill = _progress(out)[0]
        killed = time.time()
        os.killpg(procs[1].pid, signal.SIGKILL)
        _wait(lambda: _progress(out)[1] == 2 and _progress(out)[2] > killed, 120, "a step after the loss")
        resumed_step, _, stamp = _progress(out)
        code = procs[0].wait(timeout=180)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    committed = resumed_step - 1
    return {"kill_to_next_step_s": stamp - killed, "step_at_kill": at_kill, "resumed_from_commit": committed,
            "steps_lost": at_kill - committed, "steps_since_last_commit": at_kill % COMMIT_EVERY_STEPS,
            "job_exit_code": code}


def _commit_rank(role: Any, steps: int, commits: int) -> dict[str, float]:
    from fleetlike import elastic, fleet

    fleet.init(role)
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(3)])
    model = fleet.distributed_model(net)
    opt = fleet.distributed_optimizer(torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9))
    state = elastic.TorchState(model=net, optimizer=opt, step=0)
    x = torch.randn(32, 2048)

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    for _ in range(3):
        step()
    step_times, commit_times = [], []
    for _ in range(commits):  # interleaved: a few steps, one commit
        for _ in range(steps):
            t = time.perf_counter()
            step()
            step_times.append(time.perf_counter() - t)
        t = time.perf_counter()
        state.commit()
        commit_times.append(time.perf_counter() - t)
    size = sum(p.numel() * p.element_size() for p in net.parameters())
    fleet.shutdown()
    return {"step_s": median(step_times), "commit_s": median(commit_times), "model_bytes": size}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2, help="node-loss trials (default 2)")
    parser.add_argument("--commits", type=int, default=5, help="commits timed (default 5)")
    args = parser.parse_args(argv)
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        trials = [recovery_trial(Path(tmp)) for _ in range(args.trials)]
    costs = run_ranks(_commit_rank, 2, 4, args.commits, timeout=600, job_id="bench-elastic")
    cost = costs[0]
    overhead = cost["commit_s"] / 10 / cost["step_s"]
    rows = [{"what": f"node loss, trial {i + 1}", "value": t["kill_to_next_step_s"], "unit": "s kill -> next step",
             "extra": f"steps lost {t['steps_lost']} (since last commit {t['steps_since_last_commit']})"}
            for i, t in enumerate(trials)]
    rows += [{"what": "DP step, 50 MB model, 2 ranks", "value": cost["step_s"] * 1e3, "unit": "ms", "extra": ""},
             {"what": "commit(), 50 MB model + momentum", "value": cost["commit_s"] * 1e3, "unit": "ms", "extra": ""},
             {"what": "commit every 10 steps", "value": overhead * 100, "unit": "% of step time", "extra": "target <= 5 %"}]
    cols = [Column("what", "measurement"), Column("value", "value", "{:.2f}"), Column("unit", "unit"), Column("extra", "")]
    print(format_table(cols, rows))
    print(f"load average before the run: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    payload = {"run": run_info("bench.elastic", argv), "load_average": load, "trials": trials, "commit": cost,
               "commit_overhead_every_10_steps": overhead}
    save_json(OUT / "elastic.json", payload)
    _plot(trials, cost, overhead)


def _plot(trials: list[dict[str, Any]], cost: dict[str, float], overhead: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    a.bar([f"trial {i + 1}" for i in range(len(trials))], [t["kill_to_next_step_s"] for t in trials])
    a.axhline(10, color="red", linestyle="--", label="target 10 s")
    a.set_ylabel("kill -> next completed step (s)")
    a.set_title("node lost (2 -> 1 node, loopback)")
    a.legend()
    b.bar(["step", "commit / 10"], [cost["step_s"] * 1e3, cost["commit_s"] / 10 * 1e3])
    b.set_ylabel("ms")
    b.set_title(f"50 MB model: commit / 10 = {overhead:.1%} of a step")
    fig.tight_layout()
    fig.savefig(OUT / "elastic.png", dpi=100)


if __name__ == "__main__":
    main()

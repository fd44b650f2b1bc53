"""Local SGD (k=4) and adaptive local SGD vs synchronous data parallel: convergence and speed.

(a) Convergence: scikit-learn's digits, 4 gloo ranks on loopback, the runs of
    ``tests/test_localsgd_convergence.py`` (``tests/localsgd_digits.py``): loss vs step and loss
    vs bytes sent per rank, test accuracy, number of communication rounds
    -> ``docs/benchmarks/localsgd_convergence.json/.png``.
(b) Speed over a slow link: two simulated nodes (network namespaces joined by a tbf-limited veth,
    `bench.netns`) with ``--per-node`` workers each, a communication-heavy MLP (~16 MiB of
    parameters, batch 8 per rank). The three modes run in one job, interleaved round by round;
    steps/s is measured on rank 0 between barriers -> ``docs/benchmarks/localsgd_netns.json/.png``.
    Needs root (skipped with the reason otherwise).

    python -m bench.localsgd                       # both parts, ~2-4 minutes
    python -m bench.localsgd --skip-convergence --rate 1gbit --per-node 2 --steps 24 --rounds 2

(c) DiLoCo: ``--diloco`` runs `bench.diloco` after (a) and (b) (sync DP, local SGD, DiLoCo and
    Streaming DiLoCo on a small transformer over the same kind of link; see that module).

Defaults (100mbit, one worker per node) make the link the bottleneck: on this loaded 2-core
machine four ranks at 1gbit are compute-bound (see docs/BENCHMARKS.md, "Local SGD").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "docs" / "benchmarks"
SPEED_MODES = {
    "sync": {},
    "localsgd_k4": {"localsgd": True, "localsgd_configs": {"k_steps": 4, "begin_step": 1}},
    "adaptive": {"adaptive_localsgd": True, "adaptive_localsgd_configs": {"init_k_steps": 4, "begin_step": 1}},
}
IN, HID = 1024, 2048  # Linear(1024, 2048) + Linear(2048, 1024): 4.2 M params, 16 MiB
BATCH = 8


# ------------------------------------------------------------------ (a) convergence on digits


def convergence(steps: int | None) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    import localsgd_digits as d

    from fleetlike.testing import run_ranks

    steps = steps or d.STEPS
    out = {"steps": steps, "world": 4, "modes": {}}
    for mode in d.MODES:
        t0 = time.perf_counter()
        ranks = run_ranks(d.digits_run, 4, mode, steps, timeout=600)
        traces = [r["trace"] for r in ranks]
        loss = [sum(t[i]["loss"] for t in traces) / len(traces) for i in range(steps)]
        pbytes = ranks[0]["nparams_bytes"]
        if mode == "sync":
            # one gradient allreduce of every parameter per step (the step's bytes_communicated
            # stat reads 0 for data parallel, see the report: count the payload instead)
            per_step = [pbytes] * steps
            rounds = steps
        else:
            per_step = [t["bytes"] for t in traces[0]]
            rounds = traces[0][-1]["averages"]
        cum, total = [], 0
        for b in per_step:
            total += b
            cum.append(total)
        out["modes"][mode] = {
            "strategy": d.MODES[mode],
            "test_accuracy": ranks[0]["acc"],
            "rounds": rounds,
            "rounds_ratio_vs_sync": steps / rounds,
            "bytes_sent_per_rank": total,
            "final_loss_last20": sum(loss[-20:]) / 20,
            "loss": loss,
            "cum_bytes": cum,
            "k": [t["k"] for t in traces[0]],
            "wall_s": time.perf_counter() - t0,
        }
        print(f"  {mode}: acc {ranks[0]['acc']:.4f}, {rounds} rounds, {total / 2**20:.1f} MiB sent/rank", flush=True)
    out["lr"] = [d.lr_at(i, steps) for i in range(steps)]
    return out


def plot_convergence(path: Path, data: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for mode, m in data["modes"].items():
        label = f"{mode} (acc {m['test_accuracy'] * 100:.1f}%, {m['rounds']} rounds)"
        axes[0].plot(range(1, len(m["loss"]) + 1), m["loss"], label=label, linewidth=1)
        axes[1].plot([b / 2**20 for b in m["cum_bytes"]], m["loss"], label=label, linewidth=1)
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("MiB sent per rank (cumulative)")
    axes[1].set_xscale("log")
    for ax in axes:
        ax.set_yscale("log")
        ax.set_ylabel("training loss (mean over 4 ranks)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_title("loss vs step")
    axes[1].set_title("loss vs bytes sent")
    fig.suptitle("digits, 4 gloo ranks: sync SGD vs local SGD k=4 vs adaptive")
    fig.tight_layout()
    from bench._common import save_figure

    save_figure(fig, path)


# ------------------------------------------------------------------ (b) speed over a slow link


def worker(rank: int, eps: list[str], steps: int, rounds: int, out: str) -> None:
    import torch
    import torch.nn.functional as F

    from fleetlike import DistributedStrategy, Executor, fleet
    from fleetlike.roles.role import Role

    torch.set_num_threads(1)
    role = Role.from_endpoints(rank, eps, job_id="bench-localsgd")
    fleet.init(role, timeout=600)
    g = torch.Generator().manual_seed(1234)
    teacher = torch.randn(IN, IN, generator=g) / IN**0.5
    names = list(SPEED_MODES)
    times: dict[str, list[float]] = {n: [] for n in names}
    stats: dict[str, dict] = {n: {"averages": 0, "steps": 0, "ks": []} for n in names}
    step_no = {n: 0 for n in names}
    for rnd in range(rounds):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for name in order:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.ReLU(), torch.nn.Linear(HID, IN))
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            s = DistributedStrategy.from_dict(SPEED_MODES[name])
            fleet.distributed_optimizer(opt, s).minimize(lambda m, f: F.mse_loss(m(f["x"]), f["y"]), model)
            exe = Executor()
            exe.run(fleet.startup_program)

            def feed(i: int) -> dict:
                x = torch.randn(BATCH, IN, generator=torch.Generator().manual_seed(i * 97 + rank))
                return {"x": x, "y": x @ teacher}

            def lr(i: int) -> float:
                return 0.05 * 0.99 ** i

            warm = 4  # steps 1..4 (incl. the first average and adaptive's loss0), untimed
            for i in range(warm):
                for pg in opt.param_groups:
                    pg["lr"] = lr(i)
                fleet.main_program.run(feed(i))
            fleet.barrier_worker()
            t0 = time.perf_counter()
            for i in range(warm, warm + steps):
                for pg in opt.param_groups:
                    pg["lr"] = lr(i)
                st = fleet.main_program.run(feed(i))
                if name != "sync":
                    stats[name]["averages"] += bool(st.info["localsgd_averaged"])
                    stats[name]["ks"].append(st.info["localsgd_k"])
            fleet.barrier_worker()  # every rank finished: the slowest rank's pace
            times[name].append(time.perf_counter() - t0)
            stats[name]["steps"] += steps
            step_no[name] += steps
            if rank == 0:
                print(f"  round {rnd} {name}: {steps / times[name][-1]:.2f} steps/s", flush=True)
    fleet.shutdown()
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "stats": stats}))


def speed(args: argparse.Namespace) -> dict | None:
    from bench import netns
    from fleetlike.testing import free_ports

    why = netns.unavailable()
    if why:
        print(f"SKIPPED (netns part): {why}")
        return None
    n = 2 * args.per_node
    with netns.TwoNodes(rate=args.rate) as nodes, tempfile.TemporaryDirectory() as tmp:
        ports = free_ports(n)
        eps = [f"{netns.ADDRESSES[r // args.per_node]}:{ports[r]}" for r in range(n)]
        result = os.path.join(tmp, "result.json")
        spec = json.dumps({"eps": eps, "steps": args.steps, "rounds": args.rounds, "out": result})
        tx0 = [nodes.tx_bytes(i) for i in range(2)]
        codes = nodes.run_all(
            [(r // args.per_node, [sys.executable, "-m", "bench.localsgd", "--worker", str(r), "--spec", spec])
             for r in range(n)],
            cwd=ROOT,
        )
        if any(codes):
            raise RuntimeError(f"workers failed: exit codes {codes}")
        tx = [nodes.tx_bytes(i) - tx0[i] for i in range(2)]
        data = json.loads(Path(result).read_text())
    from bench._common import median

    rows = []
    sps = {k: args.steps / median(v) for k, v in data["times"].items()}
    for k, v in data["times"].items():
        st = data["stats"][k]
        rows.append({
            "mode": k,
            "steps_per_s": sps[k],
            "per_round": [args.steps / t for t in v],
            "speedup": sps[k] / sps["sync"],
            "averages_per_step": 1.0 if k == "sync" else st["averages"] / st["steps"],
            "mean_k": None if k == "sync" else sum(st["ks"]) / len(st["ks"]),
        })
    return {"rate": args.rate, "layout": f"2 nodes x {args.per_node} ranks (netns + veth + tbf)",
            "model": f"MLP Linear({IN},{HID})-ReLU-Linear({HID},{IN}), {(IN * HID * 2 + HID + IN) * 4 / 2**20:.1f} MiB fp32, batch {BATCH}/rank",
            "steps_per_round": args.steps, "rounds": args.rounds, "rows": rows, "veth_tx_bytes": tx}


def plot_speed(path: Path, data: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    names = [r["mode"] for r in rows]
    axes[0].bar(names, [r["steps_per_s"] for r in rows], color=["tab:gray", "tab:blue", "tab:orange"])
    axes[0].set_ylabel("steps/s (median over rounds)")
    axes[0].set_title("throughput")
    axes[1].bar(names, [r["speedup"] for r in rows], color=["tab:gray", "tab:blue", "tab:orange"])
    axes[1].axhline(3.0, color="tab:red", linestyle="--", linewidth=1, label="target 3x (k=4)")
    axes[1].set_ylabel("speed-up vs sync")
    axes[1].set_title("ratio")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"{data['layout']}, link tbf {data['rate']}; {data['model']}", fontsize=8)
    fig.tight_layout()
    from bench._common import save_figure

    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    from bench._common import Column, format_table, run_info, save_json

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", default="100mbit", help="tbf rate of the inter-node link")
    ap.add_argument("--per-node", type=int, default=1, choices=(1, 2), help="workers per simulated node")
    ap.add_argument("--steps", type=int, default=16, help="timed steps per mode per round (a multiple of 4)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--conv-steps", type=int, default=None, help="digits steps (default: the test's)")
    ap.add_argument("--skip-convergence", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--diloco", action="store_true", help="(c): also run bench.diloco at --rate")
    ap.add_argument("--out-dir", default=str(OUT_DIR))
    from bench._common import parse_or_run_worker

    args = parse_or_run_worker(ap, argv, worker)
    if args is None:
        return 0
    out_dir = Path(args.out_dir)
    info = run_info("bench.localsgd", argv)
    if not args.skip_convergence:
        print("(a) digits convergence, 4 ranks on loopback", flush=True)
        conv = convergence(args.conv_steps)
        rows = [{"mode": k, **v} for k, v in conv["modes"].items()]
        cols = [Column("mode", "mode"), Column("test_accuracy", "test acc", lambda v: f"{v * 100:.2f}%"),
                Column("rounds", "rounds"), Column("rounds_ratio_vs_sync", "fewer rounds", "{:.2f}x"),
                Column("bytes_sent_per_rank", "MiB sent/rank", lambda v: f"{v / 2**20:.1f}"),
                Column("final_loss_last20", "loss (last 20)", "{:.4f}")]
        print(format_table(cols, rows))
        print(format_table(cols, rows, markdown=True))
        save_json(out_dir / "localsgd_convergence.json", {**info, **conv})
        plot_convergence(out_dir / "localsgd_convergence.png", conv)
    if not args.skip_speed:
        print(f"(b) two netns nodes x {args.per_node}, link tbf {args.rate}", flush=True)
        sp = speed(args)
        if sp is not None:
            cols = [Column("mode", "mode"), Column("steps_per_s", "steps/s", "{:.2f}"),
                    Column("speedup", "vs sync", "{:.2f}x"), Column("averages_per_step", "averages/step", "{:.3f}"),
                    Column("mean_k", "mean k", "{:.2f}")]
            print(format_table(cols, sp["rows"]))
            print(format_table(cols, sp["rows"], markdown=True))
            print(f"veth tx bytes: node A {sp['veth_tx_bytes'][0]}, node B {sp['veth_tx_bytes'][1]}")
            save_json(out_dir / "localsgd_netns.json", {**info, **sp})
            plot_speed(out_dir / "localsgd_netns.png", sp)
    if args.diloco:
        from bench import diloco

        print(f"(c) DiLoCo, two netns nodes x 2, link tbf {args.rate}", flush=True)
        diloco.main(["--rate", args.rate, "--out-dir", str(out_dir)])
    return 0


if __name__ == "__main__":
    sys.exit(main())

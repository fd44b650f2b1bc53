"""The online tuner against every fixed setting of its grid, side by side in one job per cell.

Cells: models (``mlp``: 3 x Linear(512, 512), ~3 MB; ``convnet``, ``mlp50m`` of
`bench.plan_models`; ``resnet``: the ResNet example's ResNet18, small-image stem, 3x32x32, 10
classes, 45 MB) x links (``loopback``: 2 ranks on this machine; ``1gbit``, ``100mbit``: 2
network namespaces x 2 ranks joined by a rate-limited veth, `bench.netns`, root only). In each
cell one job builds one model per fixed setting of the tuner's grid (bucket size x communicators
x allreduce mode where two levels can form; settings that give the same buckets are run once)
and one with ``strategy.auto_tune``. The tuned one first tunes (its steps and wall time are the
tuning cost), then every model is timed in rounds, each round in its own (seeded) order and
each model's block after one untimed step (``--order rotate --block-warmup 0``: the earlier
rule, where a rotated order makes each model always follow the same one and the switch from it
is timed), each figure the median of its rounds: steady steps/s of the tuned job against every fixed setting and the
default (flat, 32 MB, one communicator); "tuned / same fixed" is the tuned model against the fixed
model of its chosen setting (one setting measured twice: the noise floor; ``--twin`` adds a second
model of the default, "twin / default"), "round spread" the
largest (max - min) / median of a model's rounds. Each rank's CPU seconds over the rounds are recorded:
with 4 ranks on 2 cores the figures are bounded by the cores, not the link (``cpu_share``: CPU
seconds of all ranks / (wall x cores)).

Run (as root for the namespaces; under the machine's CPU lock):
    python -m bench.autotune --links loopback,1gbit --models mlp,convnet --rounds 5 --seconds 0.5
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "docs" / "benchmarks"
BATCH = {"mlp": 32, "convnet": 16, "mlp50m": 16, "resnet": 16}
GRID_MB = (32, 1, 4, 64)  # the default first: a size giving its buckets again is not run twice
PER_NODE = 2
#: the tuned model steps until its decision, at most this many (a race of 5-step trials at 0.5 s
#: each takes up to ~70 steps per trial on a fast model: 400 cut a loopback mlp search short)
MAX_TUNING_STEPS = 3000
#: ``--twin``: a second model of the default setting, left out of the fixed settings' ranking
TWIN = "twin flat 32MB x1"


def _build(model: str) -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from bench import plan_models

    if model == "resnet":  # the ResNet example's network and digits recipe: ResNet18, 3x32x32, 10 classes
        sys.path.insert(0, str(ROOT / "examples" / "resnet"))
        from models import get_model

        torch.manual_seed(1234)
        g = torch.Generator().manual_seed(7)
        feed = {"x": torch.randn(BATCH[model], 3, 32, 32, generator=g),
                "y": torch.randint(0, 10, (BATCH[model],), generator=g)}
        return get_model("ResNet18", 10, True), lambda m, f: F.cross_entropy(m(f["x"]), f["y"]), feed
    if model != "mlp":
        return getattr(plan_models, model)(BATCH[model])
    torch.manual_seed(1234)
    net = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))
    g = torch.Generator().manual_seed(7)
    feed = {"x": torch.randn(BATCH["mlp"], 512, generator=g), "y": torch.randint(0, 512, (BATCH["mlp"],), generator=g)}
    return net, lambda m, f: F.cross_entropy(m(f["x"]), f["y"]), feed


def grid(param_bytes: list[int], two_level: bool) -> list[dict[str, Any]]:
    """The fixed settings: bucket size x communicators x mode, duplicates (same buckets) once."""
    from fleetlike.tune.space import same_buckets

    out, seen = [], set()
    for mode in (["flat", "two_level"] if two_level else ["flat"]):
        for mb in GRID_MB:
            layout = same_buckets(param_bytes, mb)
            for comm in (1, 2):
                if comm > len(layout) or (mode, layout, comm) in seen:
                    continue
                seen.add((mode, layout, comm))
                out.append({"fuse_grad_size_in_MB": mb, "nccl_comm_num": comm,
                            "use_hierarchical_allreduce": mode == "two_level"})
    return out


def _name(opts: dict[str, Any]) -> str:
    mode = "two_level" if opts.get("use_hierarchical_allreduce") else "flat"
    return f"{mode} {opts.get('fuse_grad_size_in_MB', 32):g}MB x{opts.get('nccl_comm_num', 1)}"


def worker(rank: int, eps: list[str], out: str, model: str, rounds: int, seconds: float, trial_steps: int,
           tuned_first: bool = False, order_rule: str = "shuffle", block_warmup: int = 1, twin: bool = False) -> None:
    import torch

    from fleetlike import DistributedStrategy, fleet
    from fleetlike.roles.role import Role
    from fleetlike.strategies.topology import two_level_possible

    torch.set_num_threads(1)
    fleet.init(Role.from_endpoints(rank, eps, job_id=f"bench-autotune-{os.getppid()}"), timeout=900)
    try:
        ctx = fleet.context()
        world = ctx.groups.world
        net0, _, _ = _build(model)
        sizes = [p.numel() * p.element_size() for p in net0.parameters()]
        two = two_level_possible(DistributedStrategy(), ctx.groups, ctx.role)[0]
        settings = {_name(o): o for o in grid(sizes, two)}
        if twin:  # the default built twice: how far apart one fixed setting measures in this job
            settings[TWIN] = {}
        tuned = {"auto_tune": True, "auto_tune_configs": {"steps_per_trial": trial_steps, "warmup_steps": 1}}
        # built and timed first or last: the two orders tell a place in the round from the tuner
        settings = {"tuned": tuned, **settings} if tuned_first else {**settings, "tuned": tuned}
        jobs: dict[str, Any] = {}
        for name, opts in settings.items():
            net, loss_fn, feed = _build(model)
            s = DistributedStrategy(**opts)
            m = fleet.distributed_model(net, strategy=s)
            opt = fleet.distributed_optimizer(torch.optim.SGD(net.parameters(), lr=0.001, momentum=0.9), s)

            def step(m=m, opt=opt, loss_fn=loss_fn, feed=feed) -> None:
                loss_fn(m, feed).backward()
                opt.step()
                opt.zero_grad()
            jobs[name] = step
        tuner = None
        # the tuned job tunes first: every step until its decision is the tuning cost
        fleet.barrier_worker()
        t0 = time.perf_counter()
        steps = 0
        while True:
            jobs["tuned"]()
            steps += 1
            if tuner is None:
                tuner = _tuner_of(fleet)
            if tuner.done or steps >= MAX_TUNING_STEPS:
                break
        if not tuner.done:  # its rounds would time a search still switching settings, not a decision
            raise RuntimeError(f"{model}: the tuner had not decided after {steps} steps "
                               f"({tuner.summary()}); raise MAX_TUNING_STEPS")
        fleet.barrier_worker()
        tuning = {"steps": steps, "seconds": time.perf_counter() - t0, "chosen": tuner.current.label(),
                  "done": tuner.done, "extended_races": tuner.extended_races,
                  # label, steps/s, measured steps, and how its race ended ("" for the start and re-timings)
                  "trials": [(t.setting.label(), t.steps_per_s, len(t.step_times), t.verdict, t.vs_best)
                             for t in tuner.trials]}
        # steps per round from the slowest rank's warm step of each model
        per: dict[str, int] = {}
        for name, step in jobs.items():
            for _ in range(2):
                step()
            fleet.barrier_worker()
            t = time.perf_counter()
            step()
            dt = world.all_reduce(torch.tensor([time.perf_counter() - t]), "max").item()
            per[name] = max(2, math.ceil(seconds / max(dt, 1e-6)))
        names = list(jobs)
        times: dict[str, list[float]] = {n: [] for n in names}
        cpu0, wall0 = time.process_time(), time.perf_counter()
        rng = random.Random(1234)  # one seed: the same orders on every rank
        for rnd in range(rounds):
            if order_rule == "rotate":
                shift = rnd % len(names)
                order = names[shift:] + names[:shift]
            else:
                order = rng.sample(names, len(names))
            for name in order:
                for _ in range(block_warmup):  # the switch from the model before stays out of the timing
                    jobs[name]()
                fleet.barrier_worker()
                t = time.perf_counter()
                for _ in range(per[name]):
                    jobs[name]()
                fleet.barrier_worker()
                times[name].append((time.perf_counter() - t) / per[name])
        cpu = world.all_reduce(torch.tensor([time.process_time() - cpu0]), "sum").item()
        wall = time.perf_counter() - wall0
        if rank == 0:
            Path(out).write_text(json.dumps({"times": times, "tuning": tuning, "cpu_seconds_all_ranks": cpu,
                                             "wall_seconds": wall, "ranks": world.size,
                                             "grad_bytes": sum(sizes), "two_level_possible": two,
                                             "order": names, "order_rule": order_rule,
                                             "block_warmup": block_warmup}))
    finally:
        fleet.shutdown()


def _tuner_of(fleet: Any) -> Any:
    """The tuned model's tuner (its engine is the one whose units include auto_tune)."""
    for engine in fleet._engines():
        unit = engine.unit("auto_tune")
        if unit is not None:
            return unit.tuner
    raise RuntimeError("the tuned model has no auto_tune unit")


def _run_cell(link: str, model: str, args: argparse.Namespace, out: str) -> None:
    from fleetlike.testing import free_ports

    spec = {"model": model, "rounds": args.rounds, "seconds": args.seconds, "trial_steps": args.trial_steps, "out": out,
            "tuned_first": args.tuned_first, "order_rule": args.order, "block_warmup": args.block_warmup,
            "twin": args.twin}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if link == "loopback":
        ports = free_ports(2)
        eps = [f"127.0.0.1:{p}" for p in ports]
        procs = [subprocess.Popen([sys.executable, "-m", "bench.autotune", "--worker", str(r), "--spec",
                                   json.dumps({**spec, "eps": eps})], cwd=ROOT, env=env) for r in range(2)]
        try:
            codes = [p.wait(timeout=args.timeout) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    else:
        from bench import netns

        why = netns.unavailable()
        if why:
            raise RuntimeError(f"link {link}: {why}")
        n = 2 * PER_NODE
        ports = free_ports(n)
        eps = [f"{netns.ADDRESSES[r // PER_NODE]}:{ports[r]}" for r in range(n)]
        with netns.TwoNodes(rate=link) as nodes:
            codes = nodes.run_all([(r // PER_NODE, [sys.executable, "-m", "bench.autotune", "--worker", str(r),
                                                    "--spec", json.dumps({**spec, "eps": eps})]) for r in range(n)],
                                  cwd=ROOT, env=env, timeout=args.timeout)
    if any(codes):
        raise RuntimeError(f"{link} {model}: workers failed with exit codes {codes}")


def summarise(link: str, model: str, got: dict[str, Any]) -> dict[str, Any]:
    med = {n: statistics.median(v) for n, v in got["times"].items()}
    fixed = {n: t for n, t in med.items() if n not in ("tuned", TWIN)}
    best = min(fixed, key=fixed.get)
    default = "flat 32MB x1"
    tuned_sps, best_sps, default_sps = 1 / med["tuned"], 1 / fixed[best], 1 / fixed[default]
    tuning = got["tuning"]
    cost = tuning["seconds"] - tuning["steps"] * med["tuned"]
    # the chosen setting run as a fixed model of the same job: how far apart one setting measures
    same = tuning["chosen"].rsplit(" ", 1)[0]
    same_ratio = tuned_sps * fixed[same] if same in fixed else float("nan")
    spread = max((max(v) - min(v)) / statistics.median(v) for v in got["times"].values())
    return {"link": link, "model": model, "ranks": got["ranks"], "tuned_steps_per_s": tuned_sps,
            "chosen": tuning["chosen"], "best_fixed": best, "best_fixed_steps_per_s": best_sps,
            "default_steps_per_s": default_sps, "tuned_vs_best": tuned_sps / best_sps,
            "tuned_vs_default": tuned_sps / default_sps, "best_vs_default": best_sps / default_sps,
            "tuned_vs_same_fixed": same_ratio,
            "twin_vs_default": fixed["flat 32MB x1"] / med[TWIN] if TWIN in med else float("nan"), "round_spread": spread, "tuning_steps": tuning["steps"], "tuning_seconds": tuning["seconds"], "tuning_cost_seconds": cost,
            "cpu_share": got["cpu_seconds_all_ranks"] / (got["wall_seconds"] * (os.cpu_count() or 1)),
            "fixed_steps_per_s": {n: 1 / t for n, t in fixed.items()}, "trials": tuning["trials"]}


def plot(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4))
    for i, r in enumerate(rows):
        xs = list(r["fixed_steps_per_s"].values())
        ax.scatter([i] * len(xs), xs, color="grey", s=14, label="fixed settings" if i == 0 else None)
        ax.scatter([i], [r["default_steps_per_s"]], color="tab:blue", marker="s", label="default" if i == 0 else None)
        ax.scatter([i], [r["tuned_steps_per_s"]], color="tab:red", marker="*", s=120, label="tuned" if i == 0 else None)
    ax.set_xticks(range(len(rows)), [f"{r['model']}\n{r['link']}" for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("steady steps/s")
    ax.set_title("auto_tune vs every fixed setting (median of rounds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    from bench._common import format_table, parse_or_run_worker, run_info, save_json, Column

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--links", default="loopback,1gbit,100mbit")
    ap.add_argument("--models", default="mlp,convnet,mlp50m")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=0.5, help="at least this long per model and round")
    ap.add_argument("--trial-steps", type=int, default=5, help="auto_tune_configs.steps_per_trial")
    ap.add_argument("--tuned-first", action="store_true",
                    help="build and time the tuned model first in each round's order (default: last)")
    ap.add_argument("--order", choices=("shuffle", "rotate"), default="shuffle",
                    help="each round's order of models: shuffled (seeded), or the first order rotated by one "
                         "(each model then always follows the same one)")
    ap.add_argument("--block-warmup", type=int, default=1, help="untimed steps of a model before each timed block")
    ap.add_argument("--twin", action="store_true",
                    help="also time a second model of the default setting (the 'twin / default' column)")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--out-dir", default=str(OUT_DIR))
    args = parse_or_run_worker(ap, argv, worker)
    if args is None:
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for link in [x for x in args.links.split(",") if x]:
            for model in [x for x in args.models.split(",") if x]:
                print(f"{link} {model}", flush=True)
                out = os.path.join(tmp, f"{link}-{model}.json")
                _run_cell(link, model, args, out)
                raw = json.loads(Path(out).read_text())
                rows.append({**summarise(link, model, raw), "raw": raw})
    cols = [Column("link", "link"), Column("model", "model"), Column("ranks", "ranks"),
            Column("tuned_steps_per_s", "tuned steps/s", "{:.2f}"), Column("chosen", "chosen"),
            Column("best_fixed", "best fixed"), Column("best_fixed_steps_per_s", "best steps/s", "{:.2f}"),
            Column("default_steps_per_s", "default steps/s", "{:.2f}"), Column("tuned_vs_best", "tuned/best", "{:.2f}"),
            Column("tuned_vs_default", "tuned/default", "{:.2f}"), Column("best_vs_default", "best/default", "{:.2f}"),
            Column("tuned_vs_same_fixed", "tuned/same fixed", "{:.2f}"), Column("twin_vs_default", "twin/default", "{:.2f}"), Column("round_spread", "round spread", "{:.2f}"),
            Column("tuning_steps", "tuning steps"), Column("tuning_seconds", "tuning s", "{:.1f}"),
            Column("tuning_cost_seconds", "cost s", "{:.1f}"), Column("cpu_share", "cpu share", "{:.2f}")]
    print(format_table(cols, rows))
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_json(out_dir / "autotune.json", {**run_info("bench.autotune", argv), "rounds": args.rounds,
                                          "seconds": args.seconds, "trial_steps": args.trial_steps, "rows": rows})
    plot(out_dir / "autotune.png", rows)
    print(format_table(cols, rows, markdown=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

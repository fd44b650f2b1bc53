"""How well does the planner predict? Predicted vs measured step time on a two-node netns cluster.

For each link rate (``--rates``, default 1gbit and 250mbit): two network namespaces joined by a
tbf-limited veth (`bench.netns`), 2 ranks in each (4 gloo ranks, one torch thread each):

1. probe: the four ranks run `fleetlike.plan.probe` (fleetlike's collectives on the intra,
   inter and world groups, a ladder of sizes, the world's broadcast from every root);
2. measure: per model (`bench.plan_models`: the 50 MB MLP, a conv net, a small transformer)
   one job first times the model's own forward/backward on rank 0 alone (for the record), then
   builds every strategy of
   ``--strategies`` in program style (startup and the warm-up untimed, one period timed for the
   slowest rank's step), then times ``--rounds`` rounds per strategy between barriers on rank 0,
   each of at least ``--steps`` steps and ``--seconds`` seconds (whole periods), the order of
   the strategies rotated (and reversed every other round) so drifting load falls on all; each
   figure is the median of its rounds; every round starts by timing the model's own
   forward/backward on every rank at once until a shared deadline (the compute under this very
   contention), and the median of those is the model's compute figure; with AMP strategies
   in the set, the same under bfloat16 autocast is AMP's figure;
3. predict: this process plans the same models and strategies (`fleetlike.plan.plan`, compute
   timed here with one torch thread, each trace's compute scaled by the job's all-ranks
   forward/backward time over the same work timed here alongside that trace:
   ``ModelSpec.compute_seconds``, AMP's by ``amp_compute_seconds``) with the probe's link
   figures.

Printed side by side with the error of each, Kendall's tau of the two rankings, the median
absolute error, and whether the recommended strategy (every strategy allowed) is the measured
best or within 5% of it. ``self tau`` is the measurement against itself: the tau between the
medians of the even and of the odd rounds (split half; needs 2 rounds or more). A prediction
can hardly rank the strategies better than the measurement reproduces its own ranking.
JSON and a scatter plot -> docs/benchmarks/plan_accuracy.json/.png.

    python -m bench.plan_accuracy                                    # ~70 minutes on 2 cores
    python -m bench.plan_accuracy --rates 1gbit --models convnet --rounds 1

Needs root for the namespaces (says so and stops otherwise).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "docs" / "benchmarks"
MODELS = {"mlp50m": 16, "convnet": 32, "transformer": 8}  # model -> batch per rank
STRATEGIES = ["dp", "hier", "fp16", "hier_fp16", "fp16_mixed", "sharding", "localsgd", "dp+recompute",
              "dp+amp", "dp+merge"]
PER_NODE = 2


def _role(rank: int, eps: list[str]) -> Any:
    from fleetlike.roles.role import Role

    return Role.from_endpoints(rank, eps, job_id=f"bench-plan-{os.getppid()}")


#: the autocast of the space's AMP candidates (`fleetlike.plan.space.COMPUTE`)
AMP_DTYPE = "bfloat16"


def _model_run(build: Any, batch: int, amp: str | None = None) -> Any:
    """One run of the model's own forward + loss + backward (returns its seconds, page faults
    left out as the planner leaves them out): the work whose time under all ranks at once is
    ``ModelSpec.compute_seconds`` (with ``amp``: ``amp_compute_seconds``; `model_work`)."""
    from fleetlike.plan.spec import ModelSpec, model_work
    from fleetlike.plan.trace import first_touch_seconds

    return model_work(ModelSpec(build, batch), fault_seconds=first_touch_seconds(), amp=amp)


def worker(rank: int, eps: list[str], task: str, out: str, model: str = "", strategies: list[str] | None = None,
           steps: int = 1, rounds: int = 10, seconds: float = 1.0) -> None:
    import torch

    from fleetlike import DistributedStrategy, Executor, fleet
    from fleetlike.plan.probe import compute_slowdown, compute_together, probe_worker, save
    from fleetlike.plan.space import candidates
    from fleetlike.plan.spec import Cluster, OptimizerKind
    from fleetlike.plan.trace import period_of

    torch.set_num_threads(1)
    fleet.init(_role(rank, eps), timeout=900)
    try:
        if task == "probe":
            links = probe_worker(fleet.context().groups)
            if links is not None:
                save(links, out)
            return
        from bench import plan_models

        cluster = Cluster(2, PER_NODE)
        cands = {c.name: c for c in candidates("basic", cluster)}
        build = getattr(plan_models, model)
        names = list(strategies or [])
        # this model's own forward/backward timed on every rank at once right before its
        # measurement (the same contention as the steps below); rank 0 alone for the record
        world = fleet.context().groups.world
        work = _model_run(build, MODELS[model])
        slowdown, alone, together = compute_slowdown(world, work)
        amp_work = _model_run(build, MODELS[model], AMP_DTYPE) if any(cands[n].strategy().amp for n in names) else None
        # every strategy built once and warmed up (its own model, optimizer and programs), then
        # timed in rounds, the order rotated each round: load that drifts during the job falls
        # on every strategy alike, and each figure is the median of its rounds. Many short
        # rounds: 3 rounds of 3 s reproduced their own ranking (split-half tau) at 0.56-0.69 on
        # the 1gbit conv net in four runs; 10 rounds of 1 s at 0.82
        progs: dict[str, tuple[Any, int]] = {}
        for name in names:
            s = cands[name].strategy()
            net, loss_fn, feed = build(MODELS[model])
            opt = OptimizerKind.MOMENTUM.factory(0.01)(net)
            main, startup = fleet.distributed_optimizer(opt, DistributedStrategy.from_dict(s.to_dict())).minimize(loss_fn, net)
            Executor().run(startup)
            warm, period = period_of(s)
            for _ in range(warm):
                main.run(feed)
            fleet.barrier_worker()
            t0 = time.perf_counter()
            for _ in range(period):
                main.run(feed)
            fleet.barrier_worker()
            # the slowest rank's step sets how many steps fill a round's time budget: short
            # steps timed twice were what moved a strategy's figure by up to 25% between rounds
            step = world.all_reduce(torch.tensor([(time.perf_counter() - t0) / period]), "max").item()
            n = max(steps, math.ceil(seconds / max(step, 1e-6)))
            progs[name] = (main, -(-n // period) * period, feed)
        times: dict[str, list[float]] = {s: [] for s in names}
        # the same all-ranks compute again at the start of every round, the median passed on:
        # one figure taken before the strategies were built moved by up to 30% against the
        # same work timed later in the same job (the transformer's 0.42 s read 0.46-0.55 s
        # after four strategies had run; 0.23 s at the start, 0.15-0.21 s in the rounds)
        rounds_together: list[float] = []
        rounds_amp: list[float] = []
        for rnd in range(rounds):
            rounds_together.append(compute_together(world, work, max(1.5, 6 * alone)))
            if amp_work is not None:  # AMP's own figure: contention slows it unlike float32
                rounds_amp.append(compute_together(world, amp_work, 1.5))
            shift = rnd * len(names) // max(rounds, 1)
            order = names[shift:] + names[:shift]
            if rnd % 2:
                order.reverse()
            for name in order:
                main, n, feed = progs[name]
                fleet.barrier_worker()
                t0 = time.perf_counter()
                for _ in range(n):
                    main.run(feed)
                fleet.barrier_worker()
                times[name].append((time.perf_counter() - t0) / n)
                if rank == 0:
                    print(f"    {model} {name}: {times[name][-1] * 1e3:.1f} ms/step (round {rnd})", flush=True)
        if rank == 0:
            Path(out).write_text(json.dumps({"times": times, "compute_slowdown": slowdown,
                                             "model_seconds_alone": alone, "model_seconds_at_start": together,
                                             "model_seconds_by_round": rounds_together,
                                             "model_seconds_all_ranks": statistics.median(rounds_together),
                                             "amp_seconds_by_round": rounds_amp,
                                             "amp_seconds_all_ranks": statistics.median(rounds_amp) if rounds_amp else None}))
    finally:
        fleet.shutdown()


def _run_job(nodes: Any, spec: dict[str, Any]) -> None:
    from fleetlike.testing import free_ports

    n = 2 * PER_NODE
    from bench import netns

    ports = free_ports(n)
    eps = [f"{netns.ADDRESSES[r // PER_NODE]}:{ports[r]}" for r in range(n)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    codes = nodes.run_all(
        [(r // PER_NODE, [sys.executable, "-m", "bench.plan_accuracy", "--worker", str(r),
                          "--spec", json.dumps({**spec, "eps": eps})]) for r in range(n)],
        cwd=ROOT, env=env, timeout=1500)
    if any(codes):
        raise RuntimeError(f"workers failed: exit codes {codes} ({spec['task']} {spec.get('model', '')})")


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-a of two equally long lists (pairs tied in either count as discordant-free 0)."""
    n, s = len(a), 0
    for i in range(n):
        for j in range(i + 1, n):
            s += (1 if (a[i] - a[j]) * (b[i] - b[j]) > 0 else -1 if (a[i] - a[j]) * (b[i] - b[j]) < 0 else 0)
    return s / (n * (n - 1) / 2) if n > 1 else 1.0


def predict(links_path: str, models: list[str], strategies: list[str],
            together: dict[str, float] | None = None,
            amp_together: dict[str, float | None] | None = None) -> tuple[dict[str, Any], Any, dict[str, float]]:
    """Plan ``models`` with the probe's link figures. ``together[m]``, where given, is model
    ``m``'s forward/backward seconds on every rank at once in its measurement job: its
    ``ModelSpec.compute_seconds``, so each trace scales its compute by that over the same work
    timed alongside it here; ``amp_together[m]`` the same under AMP's autocast
    (``amp_compute_seconds``, for the AMP strategies). Returns the results, the links and each
    model's median scale."""
    import torch

    from bench import plan_models
    from fleetlike.plan import Cluster, Links, MathChange, ModelSpec, plan
    from fleetlike.plan.spec import OptimizerKind

    torch.set_num_threads(1)
    links = Links.load(links_path)
    out = {}
    scales: dict[str, float] = {}
    for m in models:
        build = getattr(plan_models, m)
        spec = ModelSpec(build, MODELS[m], OptimizerKind.MOMENTUM.factory(0.01), name=m,
                         compute_seconds=(together or {}).get(m), amp_compute_seconds=(amp_together or {}).get(m))
        res = plan(spec, Cluster(2, PER_NODE), links, allow=set(MathChange), only=strategies)
        out[m] = res
        traced = [r.trace.compute_scale for r in res.rows
                  if r.trace is not None and r.trace.compute_scale is not None]
        if traced:
            scales[m] = statistics.median(traced)
    return out, links, scales


def plot(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 6))
    markers = {"mlp50m": "o", "convnet": "s", "transformer": "^"}
    colors = {}
    for r in rows:
        c = colors.setdefault(r["rate"], f"C{len(colors)}")
        ax.scatter(r["measured_s"] * 1e3, r["predicted_s"] * 1e3, marker=markers.get(r["model"], "x"), color=c,
                   s=28, alpha=0.8)
    lo = min(min(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3 * 0.8
    hi = max(max(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3 * 1.2
    ax.plot([lo, hi], [lo, hi], "k-", linewidth=0.8, label="exact")
    ax.plot([lo, hi], [lo * 1.2, hi * 1.2], "k--", linewidth=0.6, label="+-20%")
    ax.plot([lo, hi], [lo * 0.8, hi * 0.8], "k--", linewidth=0.6)
    for rate, c in colors.items():
        ax.scatter([], [], color=c, label=f"link {rate}")
    for m, mk in markers.items():
        ax.scatter([], [], color="gray", marker=mk, label=m)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured ms/step (4 gloo ranks, 2 netns nodes)")
    ax.set_ylabel("predicted ms/step (fleetlike.plan)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("planner: predicted vs measured step time")
    fig.tight_layout()
    from bench._common import save_figure

    save_figure(fig, path)


def report(args: argparse.Namespace, info: dict[str, Any], strategies: list[str], rows: list[dict[str, Any]],
           summary: list[dict[str, Any]], links_json: dict[str, Any], final: bool) -> None:
    """Print the tables (final only) and save the JSON and the plot (after every model, so an
    interrupted run keeps what it measured)."""
    from bench._common import Column, format_table, save_json

    cols = [Column("rate", "link"), Column("model", "model"), Column("strategy", "strategy"),
            Column("predicted_s", "predicted ms", lambda v: f"{v * 1e3:.1f}"),
            Column("measured_s", "measured ms", lambda v: f"{v * 1e3:.1f}"),
            Column("error", "error", lambda v: f"{v * 100:+.1f}%")]
    scols = [Column("rate", "link"), Column("model", "model"), Column("kendall_tau", "tau", "{:.2f}"),
             Column("measured_self_tau", "self tau", "{:.2f}"),
             Column("median_abs_error", "median |err|", lambda v: f"{v * 100:.1f}%"),
             Column("max_abs_error", "max |err|", lambda v: f"{v * 100:.1f}%"),
             Column("within_20pct", "within 20%"), Column("measured_best", "measured best"),
             Column("recommended", "recommended"),
             Column("recommended_vs_best", "rec vs best", lambda v: f"{v * 100:+.1f}%")]
    if final:
        for markdown in (False, True):
            print(format_table(cols, rows, markdown=markdown))
            print(format_table(scols, summary, markdown=markdown))
    out_dir = Path(args.out_dir)
    save_json(out_dir / "plan_accuracy.json", {**info, "layout": f"2 netns nodes x {PER_NODE} ranks, 1 torch thread each",
                                               "models": MODELS, "strategies": strategies, "steps": args.steps, "seconds": args.seconds,
                                               "rounds": args.rounds,
                                               "links": links_json, "rows": rows, "summary": summary,
                                               "complete": final})
    plot(out_dir / "plan_accuracy.png", rows)


def main(argv: list[str] | None = None) -> int:
    from bench._common import run_info

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="1gbit,250mbit")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--steps", type=int, default=1, help="at least this many timed steps per strategy and round "
                    "(rounded up to the period)")
    ap.add_argument("--seconds", type=float, default=1.0, help="and at least this long: steps per round from the "
                    "slowest rank's warm-up step")
    ap.add_argument("--rounds", type=int, default=10, help="rounds over the strategies, the order rotated each round")
    ap.add_argument("--out-dir", default=str(OUT_DIR))
    from bench import netns

    args = netns.driver_args(ap, argv, worker)
    if args is None:
        return 0
    models = [m for m in args.models.split(",") if m]
    strategies = [s for s in args.strategies.split(",") if s]
    info = run_info("bench.plan_accuracy", argv)
    rows: list[dict[str, Any]] = []
    summary: list[dict[str, Any]] = []
    links_json: dict[str, Any] = {}
    compute_json: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rate in args.rates.split(","):
            print(f"link {rate}: probe", flush=True)
            lp = os.path.join(tmp, f"links-{rate}.json")
            with netns.TwoNodes(rate=rate) as nodes:
                _run_job(nodes, {"task": "probe", "out": lp})
                measured: dict[str, dict[str, list[float]]] = {}
                together: dict[str, float] = {}
                amp_together: dict[str, float | None] = {}
                for m in models:
                    print(f"link {rate}: measure {m}", flush=True)
                    mp = os.path.join(tmp, f"m-{rate}-{m}.json")
                    _run_job(nodes, {"task": "measure", "out": mp, "model": m, "strategies": strategies,
                                     "steps": args.steps, "rounds": args.rounds, "seconds": args.seconds})
                    got = json.loads(Path(mp).read_text())
                    measured[m] = got["times"]
                    together[m] = got["model_seconds_all_ranks"]
                    amp_together[m] = got["amp_seconds_all_ranks"]
                    compute_json.setdefault(rate, {})[m] = {k: v for k, v in got.items() if k != "times"}
            print(f"link {rate}: predict", flush=True)
            preds, links, slowdown = predict(lp, models, strategies, together, amp_together)
            for m, x in slowdown.items():
                compute_json[rate][m]["compute_scale"] = x
                print(f"    {m}: compute x{x:.2f} (median over its traces: forward/backward on all ranks in its "
                      f"job / alongside each trace here; in-job rank 0 alone: "
                      f"x{compute_json[rate][m]['compute_slowdown']:.2f})", flush=True)
            links_json[rate] = {**links.to_json(), "compute_per_model": compute_json.get(rate, {})}
            for m in models:
                res = preds[m]
                by = {r.name: r for r in res.rows}
                pr = [by[s].cost.seconds for s in strategies]
                me = [statistics.median(measured[m][s]) for s in strategies]
                for s, p, x in zip(strategies, pr, me):
                    rows.append({"rate": rate, "model": m, "strategy": s, "predicted_s": p, "measured_s": x,
                                 "error": p / x - 1, "rounds": measured[m][s],
                                 "compute_scale": by[s].trace.compute_scale, "compute_s": by[s].cost.compute, "exposed_comm_s": by[s].cost.exposed_comm,
                                 "inter_bytes": by[s].cost.inter_bytes, "peak_bytes": by[s].memory.peak})
                best = strategies[me.index(min(me))]
                rec = res.recommended.name if res.recommended else None
                rec_measured = me[strategies.index(rec)] if rec else float("nan")
                errs = [abs(p / x - 1) for p, x in zip(pr, me)]
                halves = [[statistics.median(measured[m][s][h::2]) for s in strategies] for h in (0, 1)]
                self_tau = kendall_tau(*halves) if args.rounds >= 2 else float("nan")
                summary.append({"rate": rate, "model": m, "kendall_tau": kendall_tau(pr, me),
                                "measured_self_tau": self_tau,
                                "median_abs_error": statistics.median(errs), "max_abs_error": max(errs),
                                "within_20pct": sum(e <= 0.2 for e in errs), "n": len(errs),
                                "measured_best": best, "recommended": rec,
                                "recommended_vs_best": rec_measured / min(me) - 1})
                report(args, info, strategies, rows, summary, links_json, final=False)
    report(args, info, strategies, rows, summary, links_json, final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Data parallel training: fleetlike (program and eager style) against PyTorch DDP, on gloo.

Each of the 2 rank processes builds the same model three times from the same seed: one copy
trained by fleetlike's program style (``fleet.distributed_optimizer(opt, s).minimize(loss_fn,
model)`` then ``exe.run(fleet.main_program, feed=...)``), one by fleetlike's eager style (a plain
loop over ``fleet.distributed_model`` and ``fleet.distributed_optimizer``: ``zero_grad``,
``loss.backward()``, ``step``), and one by ``DistributedDataParallel`` over its own
``torch.distributed`` gloo process group (file rendezvous: no port), with the same bucket size
(``fuse_grad_size_in_MB`` = ``bucket_cap_mb`` = 25), optimizer (SGD) and batches. After warm-up
it alternates timed segments of ``--steps`` steps, rotating which framework goes first each
round, so noise from the machine hits all alike; steps/s is the median over ``--rounds``.

The divergence guard (a parameter checksum across the ranks, `fleetlike.collectives.divergence`)
runs in the eager style every ``FLEETLIKE_DIVERGENCE_CHECK_N_STEPS`` updates (default 200); the
program style has none. Two more eager copies time it: ``eager_off`` with the guard's period 0 (only
the check at the first step) and ``eager_n1`` checking every step. Their difference is the cost
of one check; divided by the period and by a step it is the guard's share of a step at the
default (``--no-guard`` leaves both out).

Models (per-rank batch):

=========  ===========================================  =====  ===========
name       layers                                       batch  parameters
=========  ===========================================  =====  ===========
mlp        seed MLP 32 -> 128 -> 128 -> 2 (ReLU)        128    ~21 K
conv       conv(3->16,3) pool conv(16->32,3) pool fc    32     ~21 K
mlp50m     3 x Linear(2048, 2048) + ReLU                16     12.6 M (50 MB)
=========  ===========================================  =====  ===========

Peak RSS is a per-process high-water mark, so it is measured in separate worlds: one where each
rank trains the 50 MB model with fleetlike only, one with DDP only; ``ru_maxrss`` at the end,
repeated, under glibc's default allocator settings and under the launcher's (both frameworks
alike in each).

Usage (from the repository root)::

    python -m bench.dp_vs_ddp                    # all models, 5 rounds, RSS, ~5 minutes
    python -m bench.dp_vs_ddp --models mlp --rounds 5 --steps 200 --no-rss
    python -m bench.dp_vs_ddp --profile mlp50m   # cProfile of rank 0's fleetlike steps
    python -m bench.dp_vs_ddp --profile conv --profile-frameworks eager,ddp --steps 100

Writes ``docs/benchmarks/dp_vs_ddp.json`` and ``.png`` and (re)writes the
"## Data parallel vs PyTorch DDP" section of ``docs/BENCHMARKS.md``.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

from bench._common import Column, format_table, median, run_info, save_json
from fleetlike.collectives.divergence import DEFAULT_EVERY
from fleetlike.config.envvars import DIVERGENCE_CHECK_N_STEPS

__all__ = ["MODELS", "TARGET_SPEED", "TARGET_RSS", "main"]

ROOT = Path(__file__).resolve().parents[1]
BUCKET_MB = 25
WORLD = 2
TARGET_SPEED = 1.0  # fleetlike steps/s / DDP steps/s, at least
TARGET_RSS = 1.0  # fleetlike peak RSS / DDP peak RSS, at most
SECTION = "## Data parallel vs PyTorch DDP"

#: name -> (description, per-rank batch, timed steps per segment by default, warm-up steps)
MODELS: dict[str, tuple[str, int, int, int]] = {
    "mlp": ("seed MLP 32-128-128-2", 128, 1000, 50),
    "conv": ("conv net 3x32x32, 2 conv + fc", 32, 200, 20),
    "mlp50m": ("MLP 3 x 2048x2048 (50 MB)", 16, 30, 5),
}


# ---------------------------------------------------------------------------- worker side


def _make_model(name: str) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(1234)
    if name == "mlp":
        return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 2))
    if name == "conv":
        return nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * 8 * 8, 10),
        )
    if name == "mlp50m":
        return nn.Sequential(
            nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 2048),
        )
    raise ValueError(f"model {name!r} is not one of {', '.join(MODELS)}")


def _batches(name: str, rank: int, n: int = 4) -> list[dict[str, Any]]:
    """``n`` fixed batches for this rank (cycled); identical for both frameworks."""
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    bs = MODELS[name][1]
    shape, classes = {"mlp": ((bs, 32), 2), "conv": ((bs, 3, 32, 32), 10), "mlp50m": ((bs, 2048), 2048)}[name]
    return [
        {"x": torch.randn(shape, generator=g), "y": torch.randint(0, classes, (bs,), generator=g)}
        for _ in range(n)
    ]


def _loss_fn(model: Any, feed: dict[str, Any]) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(model(feed["x"]), feed["y"])


def _fleet_stepper(role: Any, name: str, data: list[dict[str, Any]]) -> Any:
    import torch

    from fleetlike import DistributedStrategy, Executor, fleet

    model = _make_model(name)
    s = DistributedStrategy()
    s.fuse_all_reduce_ops = True
    s.fuse_grad_size_in_MB = BUCKET_MB
    fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.01), s).minimize(_loss_fn, model)
    exe = Executor()
    exe.run(fleet.startup_program)
    main = fleet.main_program
    i = [0]

    def step() -> None:
        exe.run(main, feed=data[i[0] % len(data)])
        i[0] += 1

    return step


def _eager_stepper(name: str, data: list[dict[str, Any]], every: int | None = None) -> Any:
    """The eager style's step; ``every`` (not None) is the divergence guard's period for this copy
    (the guard reads ``FLEETLIKE_DIVERGENCE_CHECK_N_STEPS`` when the first step makes it)."""
    import torch

    from fleetlike import DistributedStrategy, fleet

    s = DistributedStrategy()
    s.fuse_all_reduce_ops = True
    s.fuse_grad_size_in_MB = BUCKET_MB
    model = fleet.distributed_model(_make_model(name))
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.01), s)
    i = [0]

    def step() -> None:
        opt.zero_grad()
        _loss_fn(model, data[i[0] % len(data)]).backward()
        opt.step()
        i[0] += 1

    if every is not None:
        saved = os.environ.get(DIVERGENCE_CHECK_N_STEPS)
        os.environ[DIVERGENCE_CHECK_N_STEPS] = str(every)
        try:
            step()  # makes the guard with this period (an extra warm-up step)
        finally:
            if saved is None:
                del os.environ[DIVERGENCE_CHECK_N_STEPS]
            else:
                os.environ[DIVERGENCE_CHECK_N_STEPS] = saved
    # the guard's period and checks so far, to show each copy ran the guard it is labelled with
    step.guards = lambda: [(g.every, g.checks) for g in opt._guards.values() if g is not None]  # type: ignore[attr-defined]
    return step


def _ddp_stepper(name: str, data: list[dict[str, Any]]) -> Any:
    import torch

    model = torch.nn.parallel.DistributedDataParallel(_make_model(name), bucket_cap_mb=BUCKET_MB)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    i = [0]

    def step() -> None:
        _loss_fn(model, data[i[0] % len(data)]).backward()
        opt.step()
        opt.zero_grad()
        i[0] += 1

    return step


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


FRAMEWORKS = ("fleetlike", "eager", "ddp")
#: eager copies with the divergence guard's period set: off (0: only the first step's check), every step
GUARD_VARIANTS = {"eager_off": 0, "eager_n1": 1}


def _worker(role: Any, name: str, ddp_file: str, rounds: int, steps: int, warmup: int,
            frameworks: tuple[str, ...] = FRAMEWORKS, profile: tuple[str, ...] = ()) -> dict[str, Any]:
    """One rank: build the steppers, warm up, then alternate timed segments. Returns steps/s lists."""
    import torch.distributed as dist

    from fleetlike import fleet

    import torch

    torch.set_num_threads(1)  # run_ranks does this too; explicit here
    rss_start = _peak_rss_mib()
    data = _batches(name, role.rank)
    steppers = {}
    fleet_faces = [fw for fw in frameworks if fw != "ddp"]
    if fleet_faces:
        fleet.init(role, timeout=120)
    if "fleetlike" in frameworks:
        steppers["fleetlike"] = _fleet_stepper(role, name, data)
    if "eager" in frameworks:
        steppers["eager"] = _eager_stepper(name, data)
    for fw, every in GUARD_VARIANTS.items():
        if fw in frameworks:
            steppers[fw] = _eager_stepper(name, data, every)
    # Barriers between segments: DDP's torch.distributed group when DDP runs, else fleetlike's
    # own world, so a fleetlike-only world (the RSS measurement) holds no second process group.
    if "ddp" in frameworks:
        dist.init_process_group("gloo", init_method=f"file://{ddp_file}",
                                rank=role.rank, world_size=role.world_size)
        barrier = dist.barrier
    else:
        barrier = fleet.barrier_worker
    try:
        if "ddp" in frameworks:
            steppers["ddp"] = _ddp_stepper(name, data)
        for fn in steppers.values():
            for _ in range(warmup):
                fn()
        names = list(steppers)
        rates: dict[str, list[float]] = {n: [] for n in names}
        for r in range(rounds):
            k = r % len(names)
            for n in names[k:] + names[:k]:
                barrier()
                t0 = time.perf_counter()
                for _ in range(steps):
                    steppers[n]()
                rates[n].append(steps / (time.perf_counter() - t0))
        prof_text = ""
        for fw in profile:  # rank 0 profiled, the other rank steps alongside
            barrier()
            if role.rank == 0:
                import cProfile
                import io
                import pstats

                pr = cProfile.Profile()
                pr.enable()
                for _ in range(steps):
                    steppers[fw]()
                pr.disable()
                buf = io.StringIO()
                pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(30)
                pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(20)
                prof_text += f"==================== {fw}: {steps} steps\n" + buf.getvalue()
            else:
                for _ in range(steps):
                    steppers[fw]()
        barrier()
        guards = {fw: fn.guards() for fw, fn in steppers.items() if hasattr(fn, "guards")}
        return {"rates": rates, "rss_start_mib": rss_start, "rss_peak_mib": _peak_rss_mib(),
                "profile": prof_text or None, "guards": guards}
    finally:
        if "ddp" in frameworks:
            dist.destroy_process_group()
        if fleet_faces:
            fleet.shutdown()


# ---------------------------------------------------------------------------- driver side


def _run(name: str, rounds: int, steps: int, warmup: int, frameworks: tuple[str, ...] = FRAMEWORKS,
         profile: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    import tempfile

    from fleetlike.testing import run_ranks

    with tempfile.TemporaryDirectory() as tmp:  # DDP's rendezvous file (no port to race for)
        return run_ranks(_worker, WORLD, name, f"{tmp}/ddp", rounds, steps, warmup, frameworks, profile,
                         timeout=900)


def measure_speed(name: str, rounds: int, steps: int | None, guard: bool = True) -> dict[str, Any]:
    desc, batch, default_steps, warmup = MODELS[name]
    steps = steps or default_steps
    frameworks = FRAMEWORKS + (tuple(GUARD_VARIANTS) if guard else ())
    results = _run(name, rounds, steps, warmup, frameworks)
    # Ranks are in lockstep (every step allreduces); a step's rate is the slower rank's.
    per_round = {fw: [min(res["rates"][fw][r] for res in results) for r in range(rounds)]
                 for fw in frameworks}
    fl, ea, dd = median(per_round["fleetlike"]), median(per_round["eager"]), median(per_round["ddp"])
    row = _guard_cost(per_round, results[0]["guards"]) if guard else {}
    return {
        "model": name, "description": desc, "batch_per_rank": batch, "steps_per_segment": steps,
        "rounds": rounds, "warmup_steps": warmup,
        "fleetlike_steps_per_s": fl, "eager_steps_per_s": ea, "ddp_steps_per_s": dd,
        "ratio": fl / dd, "eager_ratio": ea / dd,
        # Same-round ratios: robust to load that drifts between rounds (a shared machine).
        "paired_ratio_median": median([a / b for a, b in zip(per_round["fleetlike"], per_round["ddp"])]),
        "eager_paired_ratio_median": median([a / b for a, b in zip(per_round["eager"], per_round["ddp"])]),
        "fleetlike_rounds": per_round["fleetlike"], "eager_rounds": per_round["eager"],
        "ddp_rounds": per_round["ddp"], **row,
    }


def _guard_cost(per_round: dict[str, list[float]], guards: dict[str, Any]) -> dict[str, Any]:
    """The guard's figures from the eager copies: its cost per check (every step minus off, in
    seconds per step) and that as a share of a step at the default period."""
    every = os.environ.get(DIVERGENCE_CHECK_N_STEPS, "").strip()
    default = int(every) if every else DEFAULT_EVERY
    off, n1, on = (median(per_round[k]) for k in ("eager_off", "eager_n1", "eager"))
    check_s = 1.0 / n1 - 1.0 / off
    return {
        "guard_every": default, "eager_off_steps_per_s": off, "eager_n1_steps_per_s": n1,
        "guard_check_ms": 1e3 * check_s,
        # one check per `default` steps, each costing check_s, on a step of 1/off seconds
        "guard_share_pct": 100.0 * check_s * off / default if default else 0.0,
        "eager_on_vs_off": median([a / b for a, b in zip(per_round["eager"], per_round["eager_off"])]),
        "eager_off_rounds": per_round["eager_off"], "eager_n1_rounds": per_round["eager_n1"],
        "guards_rank0": guards, "eager_default_steps_per_s": on,
    }


#: allocator settings the RSS worlds run under (both frameworks alike): glibc as it comes, and
#: what ``python -m fleetlike.launch`` gives its workers (``--malloc_tuning on``)
ALLOCATORS = ("glibc default", "fleetlike.launch")


def _rss_repeats(name: str, steps: int, repeats: int) -> list[dict[str, float]]:
    """``repeats`` pairs of separate worlds (fleetlike-only, DDP-only; order alternating):
    each framework's peak RSS, max over ranks. Runs in this process's allocator setting."""
    warmup = MODELS[name][3]
    runs = []
    for i in range(repeats):
        run = {}
        for fw in (("fleetlike", "ddp") if i % 2 == 0 else ("ddp", "fleetlike")):
            res = _run(name, 1, steps, warmup, frameworks=(fw,))
            run[fw] = max(r["rss_peak_mib"] for r in res)
            run[f"{fw}_start"] = max(r["rss_start_mib"] for r in res)
        runs.append(run)
    return runs


def measure_rss(name: str = "mlp50m", steps: int = 10, repeats: int = 3) -> dict[str, Any]:
    """Peak RSS per worker, fleetlike vs DDP, under each of `ALLOCATORS`.

    glibc reads its tunables at process start, so each setting runs in a fresh interpreter
    (``--rss-worker``) whose environment has ``GLIBC_TUNABLES`` removed or set as the launcher
    sets it."""
    import json
    import subprocess

    from fleetlike.launch import tuned_glibc_tunables

    out: dict[str, Any] = {"model": name, "steps": steps + MODELS[name][3], "repeats": repeats, "settings": []}
    for label in ALLOCATORS:
        env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
        if label == "fleetlike.launch":
            env["GLIBC_TUNABLES"] = tuned_glibc_tunables(None)
        proc = subprocess.run(
            [sys.executable, "-m", "bench.dp_vs_ddp", "--rss-worker", f"{name},{steps},{repeats}"],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"RSS worlds under {label!r} failed:\n{proc.stderr[-3000:]}")
        runs = json.loads(proc.stdout.strip().splitlines()[-1])
        fl, dd = median([r["fleetlike"] for r in runs]), median([r["ddp"] for r in runs])
        ratios = [r["fleetlike"] / r["ddp"] for r in runs]
        out["settings"].append({
            "allocator": label, "GLIBC_TUNABLES": env.get("GLIBC_TUNABLES", ""), "runs": runs,
            "fleetlike_peak_mib": fl, "ddp_peak_mib": dd, "ratio": fl / dd,
            "ratio_min": min(ratios), "ratio_max": max(ratios),
            "fleetlike_start_mib": median([r["fleetlike_start"] for r in runs]),
            "ddp_start_mib": median([r["ddp_start"] for r in runs]),
        })
    # the headline: what a job started with fleetlike's launcher gets
    out["ratio"] = out["settings"][-1]["ratio"]
    return out


def _plot(path: Path, rows: list[dict[str, Any]], rss: dict[str, Any] | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = 2 if rss else 1
    fig, axes = plt.subplots(1, ncols, figsize=(4.6 * ncols + 1, 3.8), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 2]} if rss else None)
    ax = axes[0][0]
    names = [r["model"] for r in rows]
    xs = list(range(len(rows)))
    for offset, key, label, hatch in ((-0.2, "ratio", "program style", ""), (0.2, "eager_ratio", "eager style", "//")):
        ratios = [r[key] for r in rows]
        colors = ["tab:green" if v >= TARGET_SPEED else "tab:red" for v in ratios]
        bars = ax.bar([x + offset for x in xs], ratios, width=0.4, color=colors, hatch=hatch, label=label,
                      edgecolor="black", linewidth=0.5)
        ax.bar_label(bars, labels=[f"{v:.2f}x" for v in ratios], fontsize=8)
    ax.set_xticks(xs, names)
    ratios = [r[k] for r in rows for k in ("ratio", "eager_ratio")]
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="DDP (1.0x)")
    ax.set_ylabel("fleetlike / DDP steps/s")
    ax.set_title("training speed (target >= 1.0)")
    ax.set_ylim(0, max(1.2, max(ratios) * 1.15))
    ax.legend(fontsize=8, loc="lower right")
    if rss:
        ax2 = axes[0][1]
        labels = [st["allocator"].replace(" ", "\n", 1) for st in rss["settings"]]
        vs = [st["ratio"] for st in rss["settings"]]
        b = ax2.bar(labels, vs, color=["tab:green" if v <= TARGET_RSS else "tab:red" for v in vs])
        ax2.errorbar(labels, vs, yerr=[[v - st["ratio_min"] for v, st in zip(vs, rss["settings"])],
                                       [st["ratio_max"] - v for v, st in zip(vs, rss["settings"])]],
                     fmt="none", ecolor="black", capsize=3, linewidth=1)
        ax2.bar_label(b, labels=[f"{v:.2f}x" for v in vs], fontsize=9, label_type="center")
        ax2.axhline(1.0, color="black", linestyle="--", linewidth=1)
        ax2.set_ylim(0, max(1.25, max(st["ratio_max"] for st in rss["settings"]) * 1.1))
        ax2.set_title(f"peak RSS, {rss['model']} (target <= 1.0)", fontsize=10)
        ax2.set_ylabel("fleetlike / DDP peak RSS")
        ax2.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"fleetlike data parallel vs PyTorch DDP, gloo, {WORLD} ranks, bucket {BUCKET_MB} MB")
    fig.tight_layout()
    from bench._common import save_figure

    save_figure(fig, path)


_SPEED_COLS = [
    Column("model", "model"),
    Column("description", "layers"),
    Column("batch_per_rank", "batch/rank"),
    Column("fleetlike_steps_per_s", "program style steps/s", "{:.1f}"),
    Column("eager_steps_per_s", "eager style steps/s", "{:.1f}"),
    Column("ddp_steps_per_s", "DDP steps/s", "{:.1f}"),
    Column("ratio", "program / DDP", "{:.3f}"),
    Column("eager_ratio", "eager / DDP", "{:.3f}"),
    Column("paired_ratio_median", "same-round program / DDP", "{:.3f}"),
    Column("eager_paired_ratio_median", "same-round eager / DDP", "{:.3f}"),
]

_GUARD_COLS = [
    Column("model", "model"),
    Column("eager_steps_per_s", "eager steps/s, guard every N", "{:.1f}"),
    Column("eager_off_steps_per_s", "guard off", "{:.1f}"),
    Column("eager_n1_steps_per_s", "check every step", "{:.1f}"),
    Column("eager_on_vs_off", "same-round on / off", "{:.3f}"),
    Column("guard_check_ms", "cost per check (ms)", "{:.2f}"),
    Column("guard_every", "N", "{}"),
    Column("guard_share_pct", "share of a step at N (%)", "{:.3f}"),
]


def _rss_rows(rss: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"allocator": st["allocator"], "fl": st["fleetlike_peak_mib"], "ddp": st["ddp_peak_mib"],
             "ratio": st["ratio"], "range": f"{st['ratio_min']:.3f}-{st['ratio_max']:.3f}",
             "runs": " / ".join(f"{r['fleetlike']:.0f} vs {r['ddp']:.0f}" for r in st["runs"]),
             "fl0": st["fleetlike_start_mib"], "ddp0": st["ddp_start_mib"]} for st in rss["settings"]]


_RSS_COLS = [
    Column("allocator", "allocator (both frameworks)"),
    Column("fl", "fleetlike peak RSS (MiB, median)", "{:.0f}"),
    Column("ddp", "DDP peak RSS (MiB, median)", "{:.0f}"),
    Column("ratio", "ratio", "{:.3f}"),
    Column("range", "per-run ratio range"),
    Column("runs", "runs: fleetlike vs DDP (MiB)"),
    Column("fl0", "fleetlike RSS at start", "{:.0f}"),
    Column("ddp0", "DDP RSS at start", "{:.0f}"),
]


def _verdict(rows: list[dict[str, Any]], rss: dict[str, Any] | None) -> str:
    lines = []
    for r in rows:
        for key, style in (("ratio", "program style"), ("eager_ratio", "eager style")):
            ok = r[key] >= TARGET_SPEED
            lines.append(f"- **{r['model']}**, {style}: fleetlike runs at {r[key]:.2f}x DDP's steps/s "
                         f"({'meets' if ok else 'misses'} the >= {TARGET_SPEED:.1f}x target"
                         + ("" if ok else f"; fleetlike is {100 * (1 - r[key]):.0f}% slower") + ").")
    if rss:
        for st in rss["settings"]:
            ok = st["ratio"] <= TARGET_RSS
            lines.append(f"- **peak RSS** ({rss['model']}, {st['allocator']} allocator for both): "
                         f"{st['ratio']:.2f}x DDP's, per run {st['ratio_min']:.2f}-{st['ratio_max']:.2f}x "
                         f"({'meets' if ok else 'misses'} the <= {TARGET_RSS:.1f}x target).")
    return "\n".join(lines)


def _write_section(path: Path, info: dict[str, Any], rows: list[dict[str, Any]], rss: dict[str, Any] | None,
                   rounds: int, notes: str) -> None:
    m = info["machine"]
    body = [
        SECTION,
        "",
        f"Command: `{info['command']}`  ",
        f"Date: {info['date']}  ",
        f"Machine: {m.get('cpus')} CPU cores ({m.get('cpu_model')}), {m.get('memory_gib', '?')} GiB, "
        f"{m.get('platform')}; Python {m.get('python')}, torch {m.get('torch')}. "
        f"{WORLD} ranks on one machine, gloo over loopback, `torch.set_num_threads(1)` per rank.",
        "",
        f"Method: each rank process trains the same model (same seed) with fleetlike's program style "
        f"(`minimize` + `Executor.run(fleet.main_program)`), with fleetlike's eager style (a plain loop "
        f"over `fleet.distributed_model` / `fleet.distributed_optimizer`) and with `DistributedDataParallel` on its own "
        f"gloo process group, same SGD, same batches, same bucket size (`fuse_grad_size_in_MB` = "
        f"`bucket_cap_mb` = {BUCKET_MB}). After warm-up, timed segments alternate (order swapped each "
        f"round), {rounds} rounds; steps/s is the slower rank's, median over rounds. "
        f"Ratio = fleetlike / DDP median steps/s (higher is better, target >= {TARGET_SPEED:.1f}); "
        "the same-round ratio is the median of per-round fleetlike/DDP ratios, which is less "
        "sensitive to load changing between rounds.",
        "",
        format_table(_SPEED_COLS, rows, markdown=True),
        "",
    ]
    if rows and "guard_check_ms" in rows[0]:
        body += [
            "The divergence guard in the eager style (the program style has none): steps/s at the "
            "default period N, with the period 0 (off) and 1 (a check every step); the cost of a "
            "check is the difference of the last two, its share of a step at N is that / N / step.",
            "",
            format_table(_GUARD_COLS, rows, markdown=True),
            "",
        ]
    if rss:
        body += [
            f"Peak RSS per worker (`ru_maxrss`, max over ranks), measured in separate worlds (one "
            f"fleetlike-only, one DDP-only, {rss['repeats']} pairs, medians) training {rss['model']} for "
            f"{rss['steps']} steps; target <= {TARGET_RSS:.1f}x. Both frameworks run under the same "
            "allocator setting, in a fresh interpreter per setting: glibc as it comes, and the "
            "setting `python -m fleetlike.launch` gives its workers (`GLIBC_TUNABLES="
            "glibc.malloc.tcache_count=0`, `--malloc_tuning on`). \"At start\" is the high-water mark "
            "when the rank function began (the forked worker with torch imported).",
            "",
            format_table(_RSS_COLS, _rss_rows(rss), markdown=True),
            "",
        ]
    load = info.get("load_average")
    if load:
        body += [f"Load average (1, 5, 15 min) at start: {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f} "
                 f"on {m.get('cpus')} cores" + (" - the machine was busy with other work; expect noise." if load[0] > 1.5 * (m.get("cpus") or 1) else "."), ""]
    body += [
        "Verdict:",
        "",
        _verdict(rows, rss),
        "",
    ]
    if notes:
        body += [notes.strip(), ""]
    body += ["Artefacts: `docs/benchmarks/dp_vs_ddp.json`, `docs/benchmarks/dp_vs_ddp.png`.", ""]
    section = "\n".join(body)
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    start = text.find(SECTION)
    if start >= 0:  # replace the previous run's section
        nxt = text.find("\n## ", start + len(SECTION))
        text = text[:start].rstrip() + "\n\n" + (text[nxt + 1:] if nxt >= 0 else "")
    path.write_text(text.rstrip() + "\n\n" + section)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.dp_vs_ddp", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--rounds", type=int, default=5, help="alternating timed rounds (median)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per segment (default per model)")
    p.add_argument("--no-rss", action="store_true", help="skip the peak-RSS worlds")
    p.add_argument("--profile", metavar="MODEL", help="only cProfile rank 0's steps on MODEL")
    p.add_argument("--profile-frameworks", default="fleetlike",
                   help=f"comma list of what --profile profiles, from {', '.join(FRAMEWORKS)}")
    p.add_argument("--no-guard", action="store_true", help="leave out the divergence guard's eager copies")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"), help="folder for JSON and PNG")
    p.add_argument("--doc", default=str(ROOT / "docs" / "BENCHMARKS.md"), help="Markdown file to update ('' = none)")
    p.add_argument("--notes", default="", help="extra text for the doc section (e.g. a profile finding)")
    p.add_argument("--rss-repeats", type=int, default=3, help="pairs of RSS worlds per allocator setting")
    p.add_argument("--rss-worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.rss_worker:  # one allocator setting's RSS worlds, in this fresh interpreter
        import json

        name, steps, repeats = args.rss_worker.split(",")
        print(json.dumps(_rss_repeats(name, int(steps), int(repeats))))
        return 0

    if args.profile:
        steps = args.steps or MODELS[args.profile][2]
        which = tuple(f.strip() for f in args.profile_frameworks.split(",") if f.strip())
        bad = [f for f in which if f not in FRAMEWORKS]
        if bad:
            p.error(f"--profile-frameworks: {', '.join(bad)} not in {', '.join(FRAMEWORKS)}")
        res = _run(args.profile, 1, steps, MODELS[args.profile][3], profile=which)
        print(res[0]["profile"])
        r = res[0]["rates"]
        print("steps/s in the timed round: " + ", ".join(f"{k} {v[0]:.1f}" for k, v in r.items()))
        return 0

    names = [n.strip() for n in args.models.split(",") if n.strip()]
    for n in names:
        if n not in MODELS:
            p.error(f"unknown model {n!r}; choose from {', '.join(MODELS)}")
    info = run_info("bench.dp_vs_ddp", argv)
    info["load_average"] = list(os.getloadavg())
    t0 = time.monotonic()
    rows = []
    for n in names:
        print(f"[{time.monotonic() - t0:6.1f}s] timing {n} ...", file=sys.stderr, flush=True)
        rows.append(measure_speed(n, args.rounds, args.steps, guard=not args.no_guard))
    rss = None
    if not args.no_rss:
        print(f"[{time.monotonic() - t0:6.1f}s] peak RSS (mlp50m, separate worlds) ...", file=sys.stderr, flush=True)
        rss = measure_rss(repeats=args.rss_repeats)
    print(f"[{time.monotonic() - t0:6.1f}s] done", file=sys.stderr, flush=True)

    print(f"fleetlike data parallel vs PyTorch DDP: gloo, {WORLD} ranks, bucket {BUCKET_MB} MB, "
          f"median of {args.rounds} alternating rounds\n")
    print(format_table(_SPEED_COLS, rows))
    if not args.no_guard:
        print()
        print(format_table(_GUARD_COLS, rows))
    if rss:
        print()
        print(format_table(_RSS_COLS, _rss_rows(rss)))
    print()
    print(_verdict(rows, rss).replace("**", ""))

    out = Path(args.out)
    payload = {**info, "world_size": WORLD, "bucket_mb": BUCKET_MB, "targets": {"speed_ratio_min": TARGET_SPEED,
               "rss_ratio_max": TARGET_RSS}, "speed": rows, "rss": rss, "elapsed_s": time.monotonic() - t0}
    print(f"\nwrote {save_json(out / 'dp_vs_ddp.json', payload)}")
    _plot(out / "dp_vs_ddp.png", rows, rss)
    print(f"wrote {out / 'dp_vs_ddp.png'}")
    if args.doc:
        _write_section(Path(args.doc), info, rows, rss, args.rounds, args.notes)
        print(f"updated {args.doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""ZeRO stages 1, 2 and 3 against torch's FSDP2 and plain data parallel, on gloo, in one run.

Each of the ``--world`` rank processes builds the same model (``--layers`` x
``Linear(--width, --width)`` with ReLU between, AdamW) from one seed, once per trainer: fleetlike
data parallel, stage 1, stage 2, stage 3 (eager loop), and torch's own ``fully_shard`` on every
Linear and the root, as its default (``fsdp2``) and with ``reshard_after_forward=False``
(``fsdp2_stage2``, its ZeRO-2 setting) (the default group stage 3 formed on the job's store),
and ``local``, a rank's step with no communication (its own model and AdamW, every rank
computing at once: the machine's bound, what any trainer's step costs at least when the ranks
share the cores). Each of ``--rounds`` rounds runs in processes of its own (under the machine's
CPU lock with ``--lock``, taken per round so other jobs interleave between rounds and none runs
inside one): every trainer built, ``--warmup`` untimed steps each, then ``--steps`` timed steps
of each in an order rotated by the round and again in the reverse order. A trainer's time in a
round is the mean of its two segments; the table reports the median over the rounds, and each
ratio the targets name (stage 3 / FSDP2 steps per second, stage 2 / stage 1) is taken within
each round, reported as the median over the rounds with its min and max.

Memory, per rank, each trainer alone in its own world: the peak RSS (``VmHWM``) above the
rank's RSS after ``fleet.init`` (glibc's mmap threshold fixed at 128 KiB with ``mallopt``, so
freed blocks go back to the system; building the model whole is included), in bytes per parameter, against each stage's model (fp32 AdamW:
16 for data parallel, 4 + 4 + 8/N for stage 1, 4 + 12/N for stage 2, 16/N + the largest block
for stage 3). Then, memory only, the model never whole on a rank: stage 3 with the model built
inside ``fleet.sharded_init()``, and torch's FSDP2 with it built on the meta device (``to_empty``,
then each Linear's ``reset_parameters`` on its shards, torch's documented way).

Usage (from the repository root)::

    python -m bench.zero                       # 2 ranks, about 2 minutes
    python -m bench.zero --lock /tmp/fleetlike-cpu.lock --time-only --kinds stage3,fsdp2,local \\
        --layers 12 --width 2048 --rounds 7 --steps 2 --no-docs --out /tmp/zero_s3
    python -m bench.zero --no-docs --out /tmp/zero
    python -m bench.zero --layers 12 --width 2048 --rounds 3 --steps 2 \\
        --section "ZeRO stages at 50M parameters" --out docs/benchmarks/zero_50m
    python -m bench.zero --memory-only --layers 48 --width 2048 --steps 3 \
        --section "ZeRO stages at 200M parameters (memory)" --out docs/benchmarks/zero_200m

``--alone`` times each trainer in rank processes of its own, one after the other within a round,
as a job runs one model per process (a process holding every trainer recycles one's freed blocks
for another, which hides what fresh memory costs); the table counts each trainer's minor page
faults per step either way. ``--bucket-mb`` sets fleetlike's gradient buckets (and DDP's; 25 by
default, DDP's own; fleetlike's default is 32)::

    python -m bench.zero --lock /tmp/fleetlike-cpu.lock --time-only --alone --bucket-mb 32 \
        --kinds stage1,stage2,local --rounds 9

``--memory-only`` skips the timed run, which holds every trainer's model in one process at once
(at 200M parameters more than the machine's memory); the memory runs hold one each.

Writes ``docs/benchmarks/zero.json`` and ``.png`` and (re)writes the "## ZeRO stages 2 and 3"
section of ``docs/BENCHMARKS.md``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import resource
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from bench._common import (Column, cpu_lock, format_table, interleaved_timings, median, proc_status,
                           replace_section, run_info, save_figure, save_json)

__all__ = ["KINDS", "main"]

KINDS = ("dp", "stage1", "torch_zero1", "stage2", "stage3", "fsdp2", "fsdp2_stage2")
#: timed only: ``local``, a rank's step with no communication (`_local`), the machine's bound
TIMED = (*KINDS, "local")
ROOT = Path(__file__).resolve().parent.parent
#: bytes per parameter of fp32 AdamW under each kind, on ``n`` ranks (plus, for stage 3 and FSDP2,
#: the largest block at full size)
MODEL = {"dp": lambda n: 16.0, "stage1": lambda n: 8 + 8 / n, "torch_zero1": lambda n: 8 + 8 / n, "stage2": lambda n: 4 + 12 / n,
         "stage3": lambda n: 16 / n, "fsdp2": lambda n: 16 / n, "fsdp2_stage2": lambda n: 4 + 12 / n, "stage3_init": lambda n: 16 / n,
         "fsdp2_meta": lambda n: 16 / n}
#: memory only: stage 3 with the model built inside ``fleet.sharded_init()`` (never whole), and
#: torch's FSDP2 with the model built on the meta device (``fully_shard``, ``to_empty``, each
#: Linear's ``reset_parameters`` on its shards: torch's documented way)
SHARDED_KINDS = ("stage3_init", "fsdp2_meta")


def _model(layers: int, width: int) -> Any:
    import torch

    torch.manual_seed(0)
    mods: list[Any] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods[:-1])


def _trainer(role: Any, kind: str, args: argparse.Namespace) -> Any:
    import torch
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard

    from fleetlike import DistributedStrategy, fleet

    g = torch.Generator().manual_seed(role.rank)
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randn(args.batch, args.width, generator=g)
    if kind == "stage3_init":
        with fleet.sharded_init():
            model = _model(args.layers, args.width)
    elif kind == "fsdp2_meta":
        with torch.device("meta"):
            model = _model(args.layers, args.width)
    else:
        model = _model(args.layers, args.width)
    if kind == "torch_zero1":  # torch's ZeRO-1: DDP (gradients as views of its buckets) + ZeroRedundancyOptimizer
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=True)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
    elif kind.startswith("fsdp2"):
        reshard = kind != "fsdp2_stage2"  # FSDP2's own ZeRO-2: gathered from the forward to the backward
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
        if kind == "fsdp2_meta":
            model.to_empty(device="cpu")
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    layer.reset_parameters()
        wrapped, opt = model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        options: dict[str, Any] = {"fuse_grad_size_in_MB": args.bucket_mb}
        if kind != "dp":
            options.update(sharding=True, sharding_configs={"sharding_degree": 0, "stage": int(kind[5])})
        wrapped = fleet.distributed_model(model)
        opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4),
                                          DistributedStrategy.from_dict(options))

    def step() -> None:
        opt.zero_grad()
        F.mse_loss(wrapped(x), y).backward()
        opt.step()

    step.held = lambda: _held(model, opt)  # type: ignore[attr-defined]
    return step


def _held(model: Any, opt: Any) -> int:
    """Bytes of this rank's own pieces of the parameters, gradients and optimizer state, each
    storage counted once and whole: a gradient that is a view of a (padded) bucket counts the
    bucket's bytes."""
    import torch

    seen: dict[int, int] = {}

    def own(t: Any) -> None:
        t = t.to_local() if hasattr(t, "to_local") else t
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()

    opt = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps its shard's optimizer there
    for p in model.parameters():
        own(p)
        if p.grad is not None:
            own(p.grad)
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v) and v.dim():
                own(v)
    return sum(seen.values())


def _local(args: argparse.Namespace) -> Any:
    """A rank's step with no communication at all: its own copy of the model, its own AdamW
    (``local``: what every trainer's step costs at least when all ranks compute at once)."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randn(args.batch, args.width, generator=g)
    model = _model(args.layers, args.width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()

    return step


def _busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (every core, every process: Linux's
    /proc/stat, all but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _round(role: Any, args: argparse.Namespace, first: int) -> dict[str, list[float]]:
    """One timed round, in processes of its own: every trainer built, ``--warmup`` untimed steps
    each, then ``--steps`` timed steps of each in an order rotated by ``first`` and again in the
    reverse order (a drift of the machine within the round hits every trainer alike); the
    seconds per step of each of its two segments, and, per segment in timed order, its wall
    seconds, this rank's CPU seconds and the machine's busy CPU seconds (what the other
    processes used is the last minus every rank's own)."""
    import torch

    from fleetlike import fleet

    fleet.init(role, timeout=300)
    from fleetlike.comm.torch_group import torch_process_group

    # torch's default group on the job's store, as stages 2 and 3 form it: FSDP2 runs on it too
    torch_process_group(fleet.context().world, fleet.device())
    names = [k for k in TIMED if k in args.kinds]
    steps = {k: (_local(args) if k == "local" else _trainer(role, k, args)) for k in names}
    for k in names:
        for _ in range(args.warmup):
            steps[k]()
    k = first % len(names)
    order = names[k:] + names[:k]
    out: dict[str, list[float]] = {n: [] for n in names}
    out.update({f"faults/{n}": [] for n in names})
    wall, own, busy = [], [], []
    for name in order + order[::-1]:
        fleet.util.barrier()
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        b0, c0, t0 = _busy_seconds(), time.process_time(), time.perf_counter()
        for _ in range(args.steps):
            steps[name]()
        t1 = time.perf_counter()
        wall.append(t1 - t0)
        own.append(time.process_time() - c0)
        busy.append(_busy_seconds() - b0)
        out[name].append((t1 - t0) / args.steps)
        out[f"faults/{name}"].append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / args.steps)
    out.update(threads=[float(torch.get_num_threads())], wall=wall, own=own, busy=busy)
    del steps
    gc.collect()
    fleet.shutdown()
    return out


def _others(ranks: list[dict[str, list[float]]]) -> float:
    """The most cores other processes used during a segment of a round (the machine's busy CPU
    seconds less every rank's own, over the segment's wall seconds; rank 0's reading of the
    machine). /proc/stat counts in clock ticks (10 ms), so segments shorter than half a second
    are read together, as the whole round."""
    segments = range(len(ranks[0]["wall"]))

    def cores(idx: Any) -> float:
        wall = sum(ranks[0]["wall"][i] for i in idx)
        return (sum(ranks[0]["busy"][i] for i in idx) - sum(r["own"][i] for r in ranks for i in idx)) / wall

    long = [i for i in segments if ranks[0]["wall"][i] >= 0.5]
    return max(cores([i]) for i in long) if long else cores(list(segments))


def _timed(args: argparse.Namespace) -> dict[str, Any]:
    """``--rounds`` rounds (`_round`), each under the lock; per trainer the seconds per step of
    each round (the mean of its two segments, the median over the ranks), and per round the
    ratios the targets name. A round during which other processes used more than ``--others``
    cores in some segment (a job that does not take the lock) is run again, at most
    ``--reruns`` times in all; the disturbed rounds are kept in the record, not in the figures."""
    from fleetlike.testing import run_ranks

    rounds: list[dict[str, float]] = []
    raw, disturbed = [], []
    reruns = args.reruns
    r = 0
    while len(rounds) < args.rounds:
        with cpu_lock(args.lock):
            load = os.getloadavg()[0]
            ranks = _alone(args, r) if args.alone else run_ranks(_round, args.world, args, r, timeout=1200)
        r += 1
        got = {k: median([sum(x[k]) / len(x[k]) for x in ranks]) for k in ranks[0] if k in TIMED}
        got.update({k: median([sum(x[k]) / len(x[k]) for x in ranks]) for k in ranks[0] if k.startswith("faults/")})
        others = _others(ranks)
        text = (f"(load {load:.2f}, others up to {others:.2f} cores): "
                + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in got.items() if k in TIMED)
                + "".join(f"; {name} {v:.3f}x" for name, v in _ratios(got).items()))
        if others > args.others and reruns > 0:
            reruns -= 1
            disturbed.append({"times": got, "others_cores": others, "raw": ranks})
            print(f"round {len(rounds) + 1}/{args.rounds} run again {text}", flush=True)
            continue
        raw.append(ranks)
        rounds.append({**got, "others_cores": others})
        print(f"round {len(rounds)}/{args.rounds} {text}", flush=True)
    return {"rounds": rounds, "raw": raw, "threads": raw[0][0]["threads"][0], "disturbed": disturbed}


def _alone(args: argparse.Namespace, first: int) -> list[dict[str, list[float]]]:
    """One round with ``--alone``: each trainer in rank processes of its own, one after the
    other in an order rotated by ``first`` (a user's job trains one model per process, so its
    heap holds no other trainer's freed blocks); per rank, every trainer's `_round` record
    merged, its segments in the order they ran."""
    from fleetlike.testing import run_ranks

    names = [k for k in TIMED if k in args.kinds]
    k = first % len(names)
    merged: list[dict[str, list[float]]] = []
    for name in names[k:] + names[:k]:
        one = argparse.Namespace(**{**vars(args), "kinds": [name]})
        for i, rank in enumerate(run_ranks(_round, args.world, one, 0, timeout=1200)):
            if len(merged) <= i:
                merged.append({"threads": rank["threads"], "wall": [], "own": [], "busy": []})
            for key, values in rank.items():
                if key != "threads":
                    merged[i].setdefault(key, []).extend(values)
    return merged


#: the targets' ratios, (faster trainer, reference): steps/s of the first over the second's
RATIOS = {"stage3/fsdp2": ("stage3", "fsdp2"), "stage2/stage1": ("stage2", "stage1")}


def _ratios(times: dict[str, float]) -> dict[str, float]:
    return {name: times[b] / times[a] for name, (a, b) in RATIOS.items() if a in times and b in times}


def _rss(role: Any, kind: str, args: argparse.Namespace) -> tuple[float, int]:
    ctypes.CDLL("libc.so.6").mallopt(-3, 131072)  # M_MMAP_THRESHOLD: freed blocks go back to the system
    from fleetlike import DistributedStrategy, fleet

    fleet.init(role, timeout=300)
    if kind.startswith("fsdp2") or kind == "torch_zero1":  # torch's default group on the job's store
        from fleetlike.comm.torch_group import torch_process_group

        torch_process_group(fleet.context().world, fleet.device())
    del DistributedStrategy
    base = proc_status("VmRSS")  # what this rank holds now (its high-water mark may be an import's)
    step = _trainer(role, kind, args)
    for _ in range(args.steps):
        step()
    peak = proc_status("VmHWM")  # the process's peak RSS: building the model whole included
    held = step.held()  # type: ignore[attr-defined]
    del step
    gc.collect()
    fleet.shutdown()
    return float(peak - base), held


#: the planner's candidate for each trainer it predicts (``fleetlike.plan``)
PLANNED = {"dp": "dp", "stage1": "sharding", "stage2": "sharding_stage2", "stage3": "sharding_stage3"}


def _builder(args: argparse.Namespace) -> Any:
    """The bench's model, data and loss as a planner builder (``batch -> (model, loss, feed)``)."""
    import torch
    import torch.nn.functional as F

    def build(batch: int) -> Any:
        model = _model(args.layers, args.width)
        g = torch.Generator().manual_seed(0)
        feed = {"x": torch.randn(batch, args.width, generator=g), "y": torch.randn(batch, args.width, generator=g)}
        return model, lambda m, f: F.mse_loss(m(f["x"]), f["y"]), feed

    return build


def _planned(args: argparse.Namespace, kinds: list[str]) -> dict[str, dict[str, int]]:
    """The planner's memory breakdown per rank for each trainer it predicts (in this process,
    one traced rank: data parallel, and stages 1 and 2 through their real engine; stage 3 derived)."""
    from fleetlike.plan import Cluster, Links, ModelSpec, OptimizerKind, plan

    wanted = {PLANNED[k]: k for k in kinds if k in PLANNED}
    if not wanted:
        return {}
    cluster = Cluster(1, args.world)
    links = Links.from_rates(intra=(50e-6, 1e9), inter=(100e-6, 1e8), cluster=cluster)
    spec = ModelSpec(_builder(args), args.batch, OptimizerKind.ADAMW.factory(1e-4))
    result = plan(spec, cluster, links, only=list(wanted))
    return {wanted[r.name]: r.memory.as_dict() for r in result.rows}


def _bounds(by: dict[str, dict[str, Any]], world: int, block: float) -> list[dict[str, Any]]:
    """The memory targets of stages 1 to 3 that were measured, each against its
    bytes-per-parameter bound and torch's figure at the same setting (ZeroRedundancyOptimizer
    over DDP for stage 1; FSDP2's ``reshard_after_forward=False`` for stage 2, its default for
    stage 3): stage 1 at most (8 + 8/N) + 10 %, stage 2 at most (4 + 12/N) + 10 %, stage 3 at
    most 16/N + 10 % + the largest block at full size (``block``, in bytes per parameter of the
    whole model)."""
    out = []
    for kind, bound, ref in (("stage1", 1.1 * (8 + 8 / world), "torch_zero1"),
                             ("stage2", 1.1 * (4 + 12 / world), "fsdp2_stage2"),
                             ("stage3", 1.1 * 16 / world + block, "fsdp2")):
        if kind not in by or ref not in by:
            continue
        got, fsdp2 = by[kind]["bytes_per_param"], by[ref]["bytes_per_param"]
        met = got <= bound and got <= fsdp2
        out.append({"kind": kind, "measured": got, "bound": bound, "fsdp2_kind": ref, "fsdp2": fsdp2, "met": met,
                    "text": f"{kind} {got:.2f} B/param against its bound {bound:.2f} and {ref}'s {fsdp2:.2f}: "
                            + ("met" if met else "NOT met")})
    return out


def _plot(path: Path, rows: list[dict[str, Any]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["kind"] for r in rows]
    a.bar(names, [r["ms"] or 0.0 for r in rows], color="#47c")
    a.set_ylabel("ms / step (median)")
    a.set_title("step time" if any(r["ms"] for r in rows) else "step time (not timed: --memory-only)")
    b.bar(names, [r["bytes_per_param"] or 0.0 for r in rows], color="#2a7", label="measured")
    b.plot(names, [r["model_bytes_per_param"] for r in rows], "k_", markersize=30, label="model")
    b.set_ylabel("peak RSS above baseline, bytes / parameter")
    if not any(r["bytes_per_param"] for r in rows):
        b.set_title("memory (not measured: --time-only)")
    b.legend()
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--bucket-mb", type=float, default=25,
                        help="fleetlike's gradient buckets (fuse_grad_size_in_MB; DDP's bucket_cap_mb is 25)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps of each trainer per segment (two segments a round)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each trainer at the start of a round")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds, each in processes of its own")
    parser.add_argument("--kinds", default=",".join(TIMED + SHARDED_KINDS),
                        help="comma-separated trainers to measure (all by default)")
    parser.add_argument("--others", type=float, default=0.2,
                        help="run a round again when other processes used more than this many cores in one of "
                             "its segments (machine CPU less the ranks' own)")
    parser.add_argument("--reruns", type=int, default=3, help="at most this many rounds run again in all")
    parser.add_argument("--lock", default=None, metavar="PATH",
                        help="take this flock (the machine's CPU lock) for each round and each memory run, "
                             "instead of the caller holding it for the whole run (do not run the bench itself "
                             "under the same lock then: it would wait for itself)")
    parser.add_argument("--memory-only", action="store_true",
                        help="measure memory only (no timed run, which holds every trainer's model at once)")
    parser.add_argument("--time-only", action="store_true", help="time only (no memory runs)")
    parser.add_argument("--alone", action="store_true",
                        help="time each trainer in rank processes of its own (by default every trainer of a round "
                             "shares its processes)")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/BENCHMARKS.md's section")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "zero"))
    parser.add_argument("--section", default="ZeRO stages 2 and 3",
                        help="the docs/BENCHMARKS.md section (re)written, e.g. one per model size")
    args = parser.parse_args(argv)
    args.kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(args.kinds) - set(TIMED + SHARDED_KINDS))
    if unknown:
        parser.error(f"--kinds: unknown {unknown}; choose from {', '.join(TIMED + SHARDED_KINDS)}")
    if args.memory_only and args.time_only:
        parser.error("--memory-only and --time-only: choose one (or neither, for both)")
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        parser.error(f"--rounds {args.rounds}, --steps {args.steps}, --warmup {args.warmup}: "
                     "at least one round of one step, and no negative warm-up")

    from fleetlike.testing import run_ranks

    load = os.getloadavg()
    timing = None if args.memory_only or not any(k in TIMED for k in args.kinds) else _timed(args)
    rounds = timing["rounds"] if timing else []
    memory_kinds = [] if args.time_only else [k for k in args.kinds if k in KINDS + SHARDED_KINDS]
    measured = {}
    for kind in memory_kinds:
        with cpu_lock(args.lock):
            measured[kind] = run_ranks(_rss, args.world, kind, args, timeout=900)
    planned = _planned(args, memory_kinds)
    rss = {kind: [r[0] for r in v] for kind, v in measured.items()}
    held = {kind: [r[1] for r in v] for kind, v in measured.items()}
    n_params = args.layers * (args.width * args.width + args.width)
    block = (args.width * args.width + args.width) * 4
    rows = []
    for kind in (k for k in KINDS if k in args.kinds):
        t = median([r[kind] for r in rounds]) if rounds else None
        per = max(rss[kind]) / n_params if kind in rss else None
        faults = median([r[f"faults/{kind}"] for r in rounds]) if rounds else None
        rows.append({"kind": kind, "ms": t * 1e3 if t else None, "steps_per_s": 1 / t if t else None,
                     "faults": faults,
                     "bytes_per_param": per, "held_bytes_per_param": max(held[kind]) / n_params if kind in held else None,
                     "model_bytes_per_param": MODEL[kind](args.world)
                     + (block / n_params if kind in ("stage3", "fsdp2") else 0.0)})
        if kind in planned and per is not None:  # the planner's per-rank peak, and what it keeps between steps
            mem = planned[kind]
            rows[-1]["planned_bytes_per_param"] = mem["peak"] / n_params
            rows[-1]["planned_kept_bytes_per_param"] = (mem["params"] + mem["grads"] + mem["optimizer"]) / n_params
            rows[-1]["measured_over_planned"] = per / rows[-1]["planned_bytes_per_param"]
    built = [{"kind": kind, "bytes_per_param": max(rss[kind]) / n_params,
              "held_bytes_per_param": max(held[kind]) / n_params,
              "model_bytes_per_param": MODEL[kind](args.world) + block / n_params} for kind in SHARDED_KINDS if kind in rss]
    by = {r["kind"]: r for r in rows if r["bytes_per_param"] is not None}
    bounds = _bounds(by, args.world, block / n_params)
    cols = [Column("kind", "trainer"), Column("ms", "ms/step", "{:.1f}"), Column("steps_per_s", "steps/s", "{:.2f}")]
    if rounds:
        cols.append(Column("faults", "minor page faults/step", "{:.0f}"))
    if rss:
        cols += [Column("bytes_per_param", "peak RSS B/param", "{:.2f}"),
                 Column("held_bytes_per_param", "tensors held B/param", "{:.2f}"),
                 Column("model_bytes_per_param", "model B/param", "{:.2f}")]
    if planned:
        cols += [Column("planned_bytes_per_param", "planner peak B/param", "{:.2f}"),
                 Column("planned_kept_bytes_per_param", "planner kept B/param", "{:.2f}"),
                 Column("measured_over_planned", "RSS / planner", "{:.3f}")]
    table = format_table(cols, rows)
    built_cols = [Column("kind", "built as shards"), Column("bytes_per_param", "peak RSS B/param", "{:.2f}"),
                  Column("held_bytes_per_param", "tensors held B/param", "{:.2f}"),
                  Column("model_bytes_per_param", "model B/param", "{:.2f}")]
    ratios: dict[str, dict[str, Any]] = {}
    lines = []
    targets = {"stage3/fsdp2": 0.9, "stage2/stage1": 0.95}
    for name in RATIOS:
        per_round = [_ratios(r)[name] for r in rounds if name in _ratios(r)]
        if not per_round:
            continue
        goal = targets[name]
        ratios[name] = {"median": median(per_round), "min": min(per_round), "max": max(per_round),
                        "rounds": per_round, "target": goal, "every_round": all(x >= goal for x in per_round)}
        a, b = RATIOS[name]
        lines.append(f"{a} steps/s {median(per_round):.3f}x {b}'s, median of {len(per_round)} rounds "
                     f"(min {min(per_round):.3f}, max {max(per_round):.3f}; target >= {goal})")
    if timing:
        lines.append(f"{len(timing['disturbed'])} round(s) run again, other processes having used more than "
                     f"{args.others:g} cores during them; in the rounds kept they used at most "
                     f"{max(r['others_cores'] for r in rounds):.2f}")
    bound = ""
    if rounds and "local" in rounds[0]:
        local = median([r["local"] for r in rounds])
        above = [f"{k} {median([r[k] for r in rounds]) / local:.2f}x" for k in ("stage3", "fsdp2", "stage1", "stage2")
                 if k in rounds[0]]
        bound = (f"the machine's bound: {args.world} ranks share {os.cpu_count()} cores "
                 f"({int(timing['threads']) if timing else '?'} torch thread(s) each); a rank's step with no "
                 f"communication (each rank its own model and AdamW, all computing at once) takes {local * 1e3:.1f} ms, "
                 "the least any trainer's step can take here; a trainer's step over it (the rest is its communication, "
                 "copies and bookkeeping): " + ", ".join(above))
    verdict = "; ".join(lines + [b["text"] for b in bounds] + ([bound] if bound else []))
    print(table)
    if built:
        print(format_table(built_cols, built))
    print(verdict)
    print(f"load average before the run: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    model = (f"{args.layers} x Linear({args.width}, {args.width}), {n_params / 1e6:.1f}M parameters, AdamW, "
             f"batch {args.batch}/rank")
    payload = {"info": run_info("bench.zero", argv if argv is not None else sys.argv[1:]), "load_average": load,
               "world": args.world, "model": model, "rows": rows, "built_as_shards": built, "bounds": bounds,
               "ratios": ratios, "ratio_stage3_fsdp2": ratios.get("stage3/fsdp2", {}).get("median"),
               "ratio_stage2_stage1": ratios.get("stage2/stage1", {}).get("median"), "machine_bound": bound,
               "rss_bytes": rss, "held_bytes": held, "planned": planned,
               "rounds": rounds, "times": timing["raw"] if timing else None,
               "disturbed_rounds": timing["disturbed"] if timing else []}
    out = Path(args.out)
    save_json(out.with_suffix(".json"), payload)
    _plot(out.with_suffix(".png"), rows, f"ZeRO stages, {args.world} ranks on gloo: {model}")
    command = "python -m bench.zero " + shlex.join(argv if argv is not None else sys.argv[1:])
    section = (
        f"## {args.section}\n\n"
        f"`{command.strip()}` ({args.world} ranks on gloo, {model}; load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} before the run; the machine is shared"
        + ("; the CPU lock taken per round" if args.lock else "")
        + ("; each trainer timed in processes of its own" if args.alone else "") + ")\n\n"
        + format_table(cols, rows, markdown=True) + "\n\n" + verdict + ".\n\n"
        + ("The model never whole on a rank (stage 3 built inside `fleet.sharded_init()`; torch's FSDP2 built on "
           "the meta device, then `to_empty` and each Linear's `reset_parameters` on its shards), peak RSS "
           "above the rank's baseline, building included:\n\n"
           + format_table(built_cols, built, markdown=True) + "\n\n" if built else "")
        + f"![zero](benchmarks/{out.name}.png)\n"
    )
    if not args.no_docs:
        replace_section(ROOT / "docs" / "BENCHMARKS.md", f"## {args.section}", section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

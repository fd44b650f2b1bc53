"""Recompute (activation checkpointing) on a transformer-like stack: step time vs saved activations.

The model is 8 pre-norm transformer blocks (LayerNorm -> multi-head self-attention -> residual ->
LayerNorm -> MLP 4x -> residual), width 128, 4 heads, sequence 64, batch 8, then a linear head;
the loss is the mean square of the output. The blocks are grouped into ``nn.Sequential`` segments
of 1, 2 or 4 consecutive blocks and fleetlike's ``apply_recompute(model, segment names)``
checkpoints each segment ("every 1 / 2 / 4 blocks"); "none" is the same weights without
recompute. All four models are built from the same seed, so they hold identical parameters.

Two measurements per configuration, in one process with ``torch.set_num_threads(2)``:

- step time: forward + backward + SGD step, configurations interleaved rep by rep (rotated
  order, `bench._common.interleaved_timings`), median over ``--reps``;
- saved-activation bytes: every tensor autograd saves for backward during one forward, seen
  through ``torch.autograd.graph.saved_tensors_hooks`` (as ``tests/test_recompute_merge.py``
  does), counted once per distinct storage and leaving out the parameters (weights are saved by
  every linear layer but are not activations). Inside a checkpointed segment torch's
  non-reentrant checkpoint installs its own inner hooks, so what the outer hook sees is exactly
  what stays alive between forward and backward: the segment boundaries.

Usage (from the repository root)::

    python -m bench.recompute               # ~0.5-2 minutes (machine load)
    python -m bench.recompute --reps 5 --inner 1

Writes ``docs/benchmarks/recompute.json`` and ``.png`` and (re)writes the "## Recompute"
section of ``docs/BENCHMARKS.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench._common import replace_section, Column, format_table, interleaved_timings, median, run_info, save_json

__all__ = ["CONFIGS", "Block", "Stack", "main", "saved_activation_bytes"]

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Recompute"
BLOCKS, WIDTH, HEADS, SEQ, BATCH = 8, 128, 4, 64, 8
#: config name -> blocks per checkpoint segment (0 = no recompute)
CONFIGS: dict[str, int] = {"none": 0, "every 4 blocks": 4, "every 2 blocks": 2, "every 1 block": 1}


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, width: int = WIDTH, heads: int = HEADS) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Stack(nn.Module):
    """``blocks`` Blocks grouped into ``segments`` (nn.Sequential of ``group`` blocks each) + head."""

    def __init__(self, group: int = 1, blocks: int = BLOCKS, width: int = WIDTH, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        made = [Block(width) for _ in range(blocks)]
        g = max(group, 1)
        self.segments = nn.ModuleList(nn.Sequential(*made[i:i + g]) for i in range(0, blocks, g))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for seg in self.segments:
            x = seg(x)
        return self.head(x)


def build(group: int) -> Stack:
    """The stack with segments of ``group`` blocks, checkpointed through fleetlike when group > 0."""
    from fleetlike.strategies.recompute import apply_recompute

    model = Stack(group)
    if group:
        apply_recompute(model, [f"segments.{i}" for i in range(len(model.segments))])
    return model


def loss_fn(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def saved_activation_bytes(model: nn.Module, x: torch.Tensor) -> dict[str, int]:
    """Bytes autograd keeps for backward after one forward: distinct non-parameter storages."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    packs = [0, 0]  # count, bytes (every pack, duplicates included)

    def pack(t: torch.Tensor) -> torch.Tensor:
        packs[0] += 1
        packs[1] += t.numel() * t.element_size()
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(model, x)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return {"bytes": sum(seen.values()), "tensors": len(seen), "packs": packs[0], "pack_bytes": packs[1]}


def _one_block_bytes(model: Stack, x: torch.Tensor) -> int:
    """Saved-activation bytes of one block (input requiring grad): what a recomputed block re-creates."""
    block = model.segments[0][0]
    h = x.clone().requires_grad_(True)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(h).sum()
    out.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def _stepper(model: nn.Module, x: torch.Tensor) -> Any:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        loss_fn(model, x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _params_equal(models: dict[str, nn.Module]) -> bool:
    ref = [p.detach().clone() for p in next(iter(models.values())).parameters()]
    return all(all(torch.equal(a, b) for a, b in zip(ref, m.parameters())) for m in models.values())


def _plot(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    for i, r in enumerate(rows):
        color = "tab:gray" if r["config"] == "none" else "tab:blue"
        ax.plot([r["mem_ratio"], r["est_peak_ratio"]], [r["time_ratio"]] * 2, color=color, linewidth=0.8)
        ax.scatter(r["mem_ratio"], r["time_ratio"], s=30, facecolors="none", edgecolors=color,
                   label="kept between forward and backward" if i == 1 else None)
        ax.scatter(r["est_peak_ratio"], r["time_ratio"], s=55, color=color,
                   label="est. peak during backward" if i == 1 else None)
        ax.annotate(f"{r['config']}: {r['time_ratio']:.2f}x time,\n{r['mem_ratio']:.2f}x kept, "
                    f"~{r['est_peak_ratio']:.2f}x peak",
                    (r["est_peak_ratio"], r["time_ratio"]), textcoords="offset points",
                    xytext={"every 1 block": (6, -24), "every 2 blocks": (10, -10), "every 4 blocks": (6, 8)}.get(r["config"], (6, 4)), fontsize=8)
    ax.legend(fontsize=8, loc="lower left")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.axvline(1.0, color="gray", linewidth=0.8)
    ax.set_xlabel("activation bytes / none")
    ax.set_ylabel("step time / none")
    ax.set_xlim(0, 1.45)
    top = max(r["time_ratio"] for r in rows)
    ax.set_ylim(min(0.9, min(r["time_ratio"] for r in rows) - 0.05), top + 0.15)
    ax.grid(True, alpha=0.3)
    ax.set_title(f"recompute trade-off: {BLOCKS} transformer blocks, width {WIDTH}, seq {SEQ}, batch {BATCH}",
                 fontsize=9)
    fig.tight_layout()
    from bench._common import save_figure

    save_figure(fig, path)


COLS = [
    Column("config", "checkpoints"),
    Column("segments", "segments"),
    Column("step_ms", "step time (ms)", "{:.1f}"),
    Column("time_ratio", "time / none", "{:.2f}"),
    Column("paired_time_ratio", "same-rep time ratio", "{:.2f}"),
    Column("saved_mib", "saved activations (MiB)", "{:.1f}"),
    Column("mem_ratio", "memory / none", "{:.3f}"),
    Column("est_peak_mib", "est. peak in backward (MiB)", "{:.1f}"),
    Column("est_peak_ratio", "est. peak / none", "{:.3f}"),
]


def _verdict(rows: list[dict[str, Any]]) -> str:
    lines = []
    for r in rows[1:]:
        lines.append(f"- **{r['config']}**: keeps {100 * r['mem_ratio']:.0f}% of the saved-activation bytes "
                     f"between forward and backward "
                     f"(~{100 * r['est_peak_ratio']:.0f}% at the backward peak, estimated) for "
                     f"{r['time_ratio']:.2f}x the step time ({100 * (r['time_ratio'] - 1):+.0f}%; "
                     f"same-rep ratio {r['paired_time_ratio']:.2f}x).")
    return "\n".join(lines)


def _write_section(path: Path, info: dict[str, Any], rows: list[dict[str, Any]], args: argparse.Namespace,
                   same: bool) -> None:
    m = info["machine"]
    load = info["load_average"]
    body = [
        SECTION, "",
        f"Command: `{info['command']}`  ",
        f"Date: {info['date']}  ",
        f"Machine: {m.get('cpus')} CPU cores ({m.get('cpu_model')}), {m.get('memory_gib', '?')} GiB, "
        f"{m.get('platform')}; Python {m.get('python')}, torch {m.get('torch')}; one process, "
        f"`torch.set_num_threads(2)`. Load average (1, 5, 15 min) at start: "
        f"{load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f} (the machine is shared with other jobs; expect noise).",
        "",
        f"Model: {BLOCKS} pre-norm transformer blocks (LayerNorm, `nn.MultiheadAttention` {HEADS} heads, "
        f"residual, LayerNorm, MLP {WIDTH}-{4 * WIDTH}-{WIDTH} GELU, residual), width {WIDTH}, sequence "
        f"{SEQ}, batch {BATCH}, fp32, loss = mean square of a linear head. Blocks are grouped in "
        "`nn.Sequential` segments of 1, 2 or 4 and each segment is checkpointed with fleetlike's "
        "`apply_recompute` (non-reentrant `torch.utils.checkpoint`); all configurations share the "
        f"same initial weights (checked: {'identical' if same else 'NOT identical'}).",
        "",
        f"Method: step = forward + backward + SGD update. Configurations interleaved rep by rep with "
        f"rotated order, {args.reps} reps of {args.inner} steps after warm-up; median. The same-rep "
        "ratio is the median of per-rep ratios (less sensitive to load drifting between reps). "
        "Saved activations: the tensors autograd keeps for backward after one forward, captured with "
        "`torch.autograd.graph.saved_tensors_hooks`, distinct storages, parameters excluded "
        "(deterministic, so measured once). This is the memory recompute saves, not the process peak, "
        "which also holds the recomputed segment's activations during its backward: the "
        "\"est. peak\" column adds g x one block's saved bytes (measured on a lone block) to the "
        "saved bytes for a segment of g blocks.",
        "",
        format_table(COLS, rows, markdown=True),
        "",
        "Verdict:",
        "",
        _verdict(rows),
        "",
        "Between forward and backward only the segment boundaries stay alive (one hidden-state "
        "tensor per segment, plus the head), so longer segments keep *less*; but while a segment's "
        "backward runs its blocks' activations exist again, so the peak grows with the segment "
        "length. Every configuration re-runs each block's forward once, so the expected time cost "
        "is about one extra forward (~1/3 of a step) whatever the segment length.",
        "",
        "Artefacts: `docs/benchmarks/recompute.json`, `docs/benchmarks/recompute.png`.",
        "",
    ]
    replace_section(path, SECTION, "\n".join(body))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.recompute", description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=15, help="interleaved timed reps per configuration (median)")
    p.add_argument("--inner", type=int, default=3, help="steps per timed rep")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"), help="folder for JSON and PNG")
    p.add_argument("--doc", default=str(ROOT / "docs" / "BENCHMARKS.md"), help="Markdown file to update ('' = none)")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    info = run_info("bench.recompute", argv)
    info["load_average"] = list(os.getloadavg())
    t0 = time.monotonic()
    torch.manual_seed(1)
    x = torch.randn(BATCH, SEQ, WIDTH)
    models = {name: build(g) for name, g in CONFIGS.items()}
    same = _params_equal(models)
    mem = {name: saved_activation_bytes(m, x) for name, m in models.items()}
    block_bytes = _one_block_bytes(models["none"], x)
    print(f"[{time.monotonic() - t0:6.1f}s] saved bytes measured; timing ...", file=sys.stderr, flush=True)
    times = interleaved_timings({n: _stepper(m, x) for n, m in models.items()}, reps=args.reps,
                                inner=args.inner, warmup=2)
    print(f"[{time.monotonic() - t0:6.1f}s] done", file=sys.stderr, flush=True)

    base_t, base_m = median(times["none"]), mem["none"]["bytes"]
    rows = []
    for name, g in CONFIGS.items():
        t = median(times[name])
        rows.append({
            "config": name, "blocks_per_segment": g, "segments": BLOCKS // g if g else 0,
            "step_ms": 1e3 * t, "time_ratio": t / base_t,
            "paired_time_ratio": median([a / b for a, b in zip(times[name], times["none"])]),
            "saved_mib": mem[name]["bytes"] / (1 << 20), "mem_ratio": mem[name]["bytes"] / base_m,
            # while a segment's backward runs, its g blocks' activations are alive again
            "est_peak_mib": (mem[name]["bytes"] + g * block_bytes) / (1 << 20),
            "est_peak_ratio": (mem[name]["bytes"] + g * block_bytes) / base_m,
            "saved_bytes": mem[name]["bytes"], "saved_tensors": mem[name]["tensors"],
            "pack_calls": mem[name]["packs"], "pack_bytes_with_duplicates": mem[name]["pack_bytes"],
            "step_s_reps": times[name],
        })

    print(f"recompute on {BLOCKS} transformer blocks (width {WIDTH}, seq {SEQ}, batch {BATCH}), "
          f"{args.threads} threads, median of {args.reps} interleaved reps x {args.inner} steps\n")
    print(format_table(COLS, rows))
    print()
    print(_verdict(rows).replace("**", ""))
    if not same:
        print("WARNING: configurations did not start from identical weights", file=sys.stderr)

    out = Path(args.out)
    payload = {**info, "model": {"blocks": BLOCKS, "width": WIDTH, "heads": HEADS, "seq": SEQ, "batch": BATCH},
               "threads": args.threads, "reps": args.reps, "inner": args.inner, "same_initial_weights": same,
               "rows": rows, "elapsed_s": time.monotonic() - t0}
    print(f"\nwrote {save_json(out / 'recompute.json', payload)}")
    _plot(out / "recompute.png", rows)
    print(f"wrote {out / 'recompute.png'}")
    if args.doc:
        _write_section(Path(args.doc), info, rows, args, same)
        print(f"updated {args.doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where ZeRO stage 2's and FSDP2's stage-2 setting peak within a step: each phase's peak RSS above its start.

Each of 2 rank processes (gloo) builds ``--layers`` x ``Linear(--width, --width)`` (ReLU between,
AdamW, batch 16 per rank, the model of `bench.zero`) and trains ``--steps`` steps under one
trainer: fleetlike's stage 2 (the bucket engine with transient gradient buckets, 25 MB buckets)
or torch's FSDP2 with ``reshard_after_forward=False`` on every Linear and the root. Around the
forward, the backward and the update of every step the rank resets its peak RSS (``VmHWM``,
Linux's ``/proc/self/clear_refs``) and reads how far above the phase's start it went, and where
it ended; glibc's mmap threshold is fixed at 128 KiB, so freed blocks go back to the system. It
reads gloo's scratch for one allreduce of the largest parameter the same way. Step 0 creates
AdamW's state; the later steps are the steady state.

Usage (from the repository root, under the machine's CPU lock)::

    python -m bench.zero_phases --layers 12 --width 2048 --steps 3 --out docs/benchmarks/zero_phases
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import sys
from pathlib import Path
from typing import Any

from bench._common import Column, format_table, run_info, save_json

__all__ = ["main"]

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
KINDS = ("stage2", "fsdp2_stage2")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1]) * 1024


def _reset_peak() -> None:
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS starts again from the current RSS


def _phase(fn: Any) -> tuple[Any, float, float]:
    """``fn()``, its peak RSS above its start and its end above its start, in MiB."""
    _reset_peak()
    start = _status("VmRSS")
    out = fn()
    return out, (_status("VmHWM") - start) / MIB, (_status("VmRSS") - start) / MIB


def _rank(role: Any, kind: str, args: argparse.Namespace) -> dict[str, Any]:
    ctypes.CDLL("libc.so.6").mallopt(-3, 131072)  # M_MMAP_THRESHOLD: freed blocks go back to the system
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from fleetlike import DistributedStrategy, fleet
    from fleetlike.comm.torch_group import torch_process_group

    fleet.init(role, timeout=300)
    torch_process_group(fleet.context().world, fleet.device())
    buf = torch.ones(args.width * args.width)
    _, scratch, _ = _phase(lambda: dist.all_reduce(buf))
    del buf
    torch.manual_seed(0)
    mods: list[Any] = []
    for _ in range(args.layers):
        mods += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*mods[:-1])
    g = torch.Generator().manual_seed(role.rank)
    x, y = torch.randn(16, args.width, generator=g), torch.randn(16, args.width, generator=g)
    if kind == "stage2":
        wrapped = fleet.distributed_model(model)
        opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), DistributedStrategy.from_dict(
            {"fuse_grad_size_in_MB": 25, "sharding": True, "sharding_configs": {"sharding_degree": 0, "stage": 2}}))
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, reshard_after_forward=False)
        fully_shard(model, reshard_after_forward=False)
        wrapped, opt = model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    rows = []
    for step in range(args.steps):
        opt.zero_grad()
        loss, fwd, fwd_end = _phase(lambda: F.mse_loss(wrapped(x), y))
        _, bwd, bwd_end = _phase(loss.backward)
        _, upd, upd_end = _phase(opt.step)
        rows.append({"kind": kind, "rank": role.rank, "step": step, "forward": fwd, "forward_end": fwd_end,
                     "backward": bwd, "backward_end": bwd_end, "update": upd, "update_end": upd_end,
                     "allreduce_scratch": scratch})
    fleet.shutdown()
    return {"rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "zero_phases"))
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error(f"--steps {args.steps}: at least 2 (step 0 creates the optimizer state; the steady state follows)")
    from fleetlike.testing import run_ranks

    rows = [row for kind in KINDS for res in run_ranks(_rank, 2, kind, args, timeout=600) for row in res["rows"]]
    cols = [Column("kind", "trainer"), Column("rank", "rank"), Column("step", "step"),
            Column("forward", "forward peak MiB", "{:+.1f}"), Column("forward_end", "end", "{:+.1f}"),
            Column("backward", "backward peak MiB", "{:+.1f}"), Column("backward_end", "end", "{:+.1f}"),
            Column("update", "update peak MiB", "{:+.1f}"), Column("update_end", "end", "{:+.1f}"),
            Column("allreduce_scratch", "gloo scratch MiB", "{:.1f}")]
    print(format_table(cols, rows))
    save_json(Path(args.out).with_suffix(".json"),
              {"info": run_info("bench.zero_phases", argv if argv is not None else sys.argv[1:]),
               "model": f"{args.layers} x Linear({args.width}, {args.width}), AdamW, batch 16/rank, 2 ranks on gloo",
               "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

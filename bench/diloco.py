"""DiLoCo vs Paddle's local SGD vs synchronous data parallel on a small transformer language model.

Four workers as two simulated nodes (network namespaces joined by a tbf-limited veth,
`bench.netns`; ``--loopback`` runs them on 127.0.0.x instead), each mode trained in the plain
PyTorch loop (``fleet.distributed_model`` / ``distributed_optimizer``) from the same
initialisation on the same data:

- ``sync``: data parallel, gradients averaged every step;
- ``localsgd_H``: Paddle's local SGD, parameters averaged every H steps;
- ``diloco_H``: DiLoCo, the averaged change every H steps applied by an outer Nesterov step
  (``--outer-lr``/``--outer-momentum``; 0.7 and 0.9 as in the paper by default, 1.0 and 0.5 suit
  runs of a few dozen outer steps: docs/BENCHMARKS.md);
- ``streaming_H``: Streaming DiLoCo, the model in F fragments synced H/F steps apart, each sync
  overlapping one inner step, pseudo-gradients in bfloat16.

Data: a byte-level language model on the Python standard library's own source files (the
``.py`` files of the running interpreter's ``Lib``: text every Python installation ships; files
sorted by name, the first ones for training, a disjoint set for validation). Inner optimizer
AdamW with warm-up and cosine decay, batch 16 x 64 bytes per worker.

Reports steps/s (timed steps only, evaluation excluded), validation loss every ``--eval-every``
steps (rank 0's model; at multiples of H the DiLoCo and local SGD models are synced), bytes each
rank sends per step (the largest step after the warm-up, whose steps <= ``--begin`` average the
whole model in every local SGD mode: the peak a link must carry) and in total. Saves
``docs/benchmarks/diloco.json`` and ``.png`` (validation loss vs steps and vs wall time).

    python -m bench.diloco                       # 2 netns nodes x 2, 1gbit, H=50, 500 steps
    python -m bench.diloco --loopback --steps 200 --H 50
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "docs" / "benchmarks"
CTX, BATCH, D_MODEL, LAYERS, HEADS = 64, 16, 128, 2, 4


def modes(h: int, fragments: int, begin: int = 1, outer_lr: float = 0.7, outer_momentum: float = 0.9,
          only: list[str] | None = None) -> dict[str, dict[str, Any]]:
    local = {"localsgd": True}
    outer = {"outer_optimizer": "nesterov", "outer_lr": outer_lr, "outer_momentum": outer_momentum}
    every = {
        "sync": {},
        f"localsgd_{h}": {**local, "localsgd_configs": {"k_steps": h, "begin_step": begin}},
        f"diloco_{h}": {**local, "localsgd_configs": {"k_steps": h, "begin_step": begin, **outer}},
        f"streaming_{h}": {**local, "localsgd_configs": {
            "k_steps": h, "begin_step": begin, **outer,
            "fragments": fragments, "overlap": 1, "overlap_alpha": 0.5, "sync_dtype": "bfloat16"}},
    }
    return {name: cfg for name, cfg in every.items() if not only or name.split("_")[0] in only}


def corpus() -> tuple[bytes, bytes]:
    """(train, validation) bytes from the standard library's sources (see the module doc)."""
    lib = Path(os.__file__).resolve().parent
    files = sorted(p for p in lib.glob("*.py") if p.is_file())
    train = b"".join(p.read_bytes() for p in files[:120])[: 3 << 20]
    val = b"".join(p.read_bytes() for p in files[-40:])[: 256 << 10]
    return train, val


def build_model() -> Any:
    import torch

    class TinyLM(torch.nn.Module):
        """A byte-level causal transformer (pre-norm encoder layers with a causal mask)."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(256, D_MODEL)
            self.pos = torch.nn.Parameter(torch.zeros(CTX, D_MODEL))
            layer = torch.nn.TransformerEncoderLayer(D_MODEL, HEADS, 4 * D_MODEL, dropout=0.0,
                                                     batch_first=True, norm_first=True)
            self.blocks = torch.nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
            self.norm = torch.nn.LayerNorm(D_MODEL)
            self.head = torch.nn.Linear(D_MODEL, 256)
            self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(CTX), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.embed(x) + self.pos[: x.shape[1]]
            h = self.blocks(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)
            return self.head(self.norm(h))

    torch.manual_seed(0)
    return TinyLM()


def worker(rank: int, eps: list[str], steps: int, h: int, fragments: int, eval_every: int, out: str,
           begin: int = 1, outer_lr: float = 0.7, outer_momentum: float = 0.9, only: list[str] | None = None) -> None:
    import torch
    import torch.nn.functional as F

    from fleetlike import DistributedStrategy, fleet
    from fleetlike.roles.role import Role

    torch.set_num_threads(1)
    train, val = corpus()
    tdata = torch.frombuffer(bytearray(train), dtype=torch.uint8).long()
    vdata = torch.frombuffer(bytearray(val), dtype=torch.uint8).long()
    g = torch.Generator().manual_seed(99)
    vidx = torch.randint(0, len(vdata) - CTX - 1, (8, 32), generator=g)
    role = Role.from_endpoints(rank, eps, job_id="bench-diloco")
    results: dict[str, Any] = {}
    for name, cfg in modes(h, fragments, begin, outer_lr, outer_momentum, only).items():
        fleet.init(role, timeout=600)
        model = fleet.distributed_model(build_model())
        inner = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
        opt = fleet.distributed_optimizer(inner, DistributedStrategy.from_dict(cfg))
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda i: min(1.0, (i + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * i / steps))))
        rng = torch.Generator().manual_seed(1000 + rank)  # the same data stream in every mode

        def evaluate() -> float:
            model.eval()
            with torch.no_grad():
                losses = []
                for row in vidx:
                    x = torch.stack([vdata[i : i + CTX] for i in row])
                    y = torch.stack([vdata[i + 1 : i + CTX + 1] for i in row])
                    losses.append(float(F.cross_entropy(model.module(x).reshape(-1, 256), y.reshape(-1))))
            model.train()
            return sum(losses) / len(losses)

        curve, sent, clock = [], [], 0.0
        fleet.barrier_worker()
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            idx = torch.randint(0, len(tdata) - CTX - 1, (BATCH,), generator=rng)
            x = torch.stack([tdata[i : i + CTX] for i in idx])
            y = torch.stack([tdata[i + 1 : i + CTX + 1] for i in idx])
            opt.zero_grad()
            loss = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
            loss.backward()
            opt.step()
            sched.step()
            clock += time.perf_counter() - t0
            sent.append(int(opt.step_info.get("bytes_communicated", 0)))
            if step % eval_every == 0 or step == steps:
                fleet.barrier_worker()  # every rank reached this step: the slowest rank's pace
                if rank == 0:
                    curve.append({"step": step, "val_loss": evaluate(), "wall_s": clock,
                                  "train_loss": float(loss.detach())})
                    print(f"  {name} step {step}: val {curve[-1]['val_loss']:.4f} "
                          f"({step / clock:.2f} steps/s)", flush=True)
                fleet.barrier_worker()
        # peak after the warm-up: local SGD's warm-up steps (<= begin_step) average the whole model
        results[name] = {"strategy": cfg, "curve": curve, "steps_per_s": steps / clock,
                         "peak_bytes_per_step": max(sent[begin:]), "total_bytes": sum(sent),
                         "applied": [str(e) for e in fleet.applied_strategy()]}
        fleet.shutdown()
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    from fleetlike.testing import free_ports

    n = 4
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        spec = {"steps": args.steps, "h": args.H, "fragments": args.fragments, "eval_every": args.eval_every,
                "out": result, "begin": args.begin,
                "outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum, "only": args.only}
        argv = [sys.executable, "-m", "bench.diloco", "--worker"]
        if args.loopback:
            import subprocess

            ports = free_ports(n)
            eps = [f"127.0.0.{1 + r // 2}:{ports[r]}" for r in range(n)]
            procs = [subprocess.Popen([*argv, str(r), "--spec", json.dumps({**spec, "eps": eps})], cwd=ROOT)
                     for r in range(n)]
            try:
                codes = [p.wait(timeout=3600) for p in procs]
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            link = "loopback (127.0.0.1 / 127.0.0.2 as two nodes)"
        else:
            from bench import netns

            why = netns.unavailable()
            if why:
                print(f"SKIPPED: {why} (or pass --loopback)")
                return None
            with netns.TwoNodes(rate=args.rate) as nodes:
                ports = free_ports(n)
                eps = [f"{netns.ADDRESSES[r // 2]}:{ports[r]}" for r in range(n)]
                codes = nodes.run_all([(r // 2, [*argv, str(r), "--spec", json.dumps({**spec, "eps": eps})])
                                       for r in range(n)], cwd=ROOT, timeout=3600)
            link = f"2 netns nodes x 2 ranks, veth tbf {args.rate}"
        if any(codes):
            raise RuntimeError(f"workers failed: exit codes {codes}")
        data = json.loads(Path(result).read_text())
    return {"link": link, "H": args.H, "fragments": args.fragments, "steps": args.steps, "begin_step": args.begin,
            "model": f"byte-level transformer, {LAYERS} layers, d={D_MODEL}, ctx {CTX}, batch {BATCH}/worker",
            "modes": data}


def rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    m = data["modes"]
    h = data["H"]
    nan = float("nan")
    sync_loss = m["sync"]["curve"][-1]["val_loss"] if "sync" in m else nan
    local_sps = m[f"localsgd_{h}"]["steps_per_s"] if f"localsgd_{h}" in m else nan
    out = []
    for name, r in m.items():
        loss = r["curve"][-1]["val_loss"]
        out.append({"mode": name, "steps_per_s": r["steps_per_s"], "vs_localsgd": r["steps_per_s"] / local_sps,
                    "val_loss": loss, "vs_sync": (loss - sync_loss) / sync_loss,
                    "peak_bytes": r["peak_bytes_per_step"], "total_bytes": r["total_bytes"]})
    return out


def plot(path: Path, data: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, r in data["modes"].items():
        steps = [c["step"] for c in r["curve"]]
        loss = [c["val_loss"] for c in r["curve"]]
        axes[0].plot(steps, loss, marker=".", label=name)
        axes[1].plot([c["wall_s"] for c in r["curve"]], loss, marker=".", label=name)
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("training wall time (s, evaluation excluded)")
    for ax in axes:
        ax.set_ylabel("validation loss (bytes, nats)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{data['model']}; {data['link']}; H={data['H']}, {data['fragments']} fragments", fontsize=8)
    fig.tight_layout()
    from bench._common import save_figure

    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    from bench._common import Column, format_table, run_info, save_json

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", default="1gbit", help="tbf rate of the inter-node link")
    ap.add_argument("--loopback", action="store_true", help="no namespaces: ranks on 127.0.0.1/2")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--H", type=int, default=50, help="inner steps between syncs (k_steps)")
    ap.add_argument("--fragments", type=int, default=5, help="Streaming DiLoCo's fragments (divides H)")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--begin", type=int, default=1, help="local SGD's begin_step: synchronous warm-up steps")
    ap.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer Nesterov learning rate")
    ap.add_argument("--outer-momentum", type=float, default=0.9, help="DiLoCo's outer Nesterov momentum")
    ap.add_argument("--only", type=lambda s: s.split(","), default=None,
                    help="comma-separated subset of sync,localsgd,diloco,streaming (the table needs sync and localsgd)")
    ap.add_argument("--out-dir", default=str(OUT_DIR))
    from bench._common import parse_or_run_worker

    args = parse_or_run_worker(ap, argv, worker)
    if args is None:
        return 0
    if args.H % args.fragments:
        ap.error(f"--fragments {args.fragments} must divide --H {args.H}")
    info = run_info("bench.diloco", argv)
    data = run(args)
    if data is None:
        return 0
    table = rows(data)
    cols = [Column("mode", "mode"), Column("steps_per_s", "steps/s", "{:.2f}"),
            Column("vs_localsgd", "vs local SGD", "{:.2f}x"), Column("val_loss", "val loss", "{:.4f}"),
            Column("vs_sync", "vs sync", lambda v: f"{v * 100:+.2f}%"),
            Column("peak_bytes", "peak KiB/step", lambda v: f"{v / 1024:.0f}"),
            Column("total_bytes", "MiB sent", lambda v: f"{v / 2**20:.1f}")]
    print(format_table(cols, table))
    print(format_table(cols, table, markdown=True))
    out = Path(args.out_dir)
    save_json(out / "diloco.json", {**info, **data, "rows": table})
    plot(out / "diloco.png", data)
    return 0


if __name__ == "__main__":
    sys.exit(main())

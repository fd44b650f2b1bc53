"""A tiny transformer-style model, its data and single-process references for the ZeRO stage 2
and 3 tests: an embedding, six blocks of attention + MLP with LayerNorm, a final LayerNorm and
an output head tied to the embedding (one parameter reached from two modules). Sizes are odd on
purpose (dim 0 of 11, 9, 18 rows), so 2 and 3 ranks cut them into uneven shards with padding.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

VOCAB, DIM, HEADS, SEQ, BLOCKS = 11, 6, 2, 5, 6
GLOBAL_BATCH = 6
STEPS = 10


class Block(torch.nn.Module):
    """Pre-LayerNorm attention (one fused qkv projection) and a GELU MLP, both residual."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(DIM)
        self.qkv = torch.nn.Linear(DIM, 3 * DIM)
        self.proj = torch.nn.Linear(DIM, DIM)
        self.ln2 = torch.nn.LayerNorm(DIM)
        self.up = torch.nn.Linear(DIM, 3 * DIM)
        self.down = torch.nn.Linear(3 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-1, -2) / (d // HEADS) ** 0.5, dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyLM(torch.nn.Module):
    """Embedding, ``BLOCKS`` blocks, LayerNorm, a head tied to the embedding; a step counter
    buffer (a buffer the sharded model keeps whole)."""

    def __init__(self, seed: int = 7) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.pos = torch.nn.Parameter(torch.randn(SEQ, DIM) * 0.1)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
        self.ln = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            self.seen += tokens.shape[0]
        x = self.embed(tokens) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def global_batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return {"x": torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
            "y": torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)}


def batch(step: int, rank: int, world: int) -> dict[str, torch.Tensor]:
    n = GLOBAL_BATCH // world
    return {k: v[rank * n:(rank + 1) * n] for k, v in global_batch(step).items()}


def loss_fn(model: torch.nn.Module, feed: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(feed["x"]).float().reshape(-1, VOCAB), feed["y"].reshape(-1))


def make_opt(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "momentum":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.05)
    raise ValueError(name)


def state(sd: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.detach().double().numpy().copy() for k, v in sd.items() if v.is_floating_point()}


def rel_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """The largest over parameters of max|a - b| / max|b| (every parameter relative to its own scale)."""
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(float(np.abs(a[k] - b[k]).max() / max(np.abs(b[k]).max(), 1e-12)) for k in b)


def reference(opt_name: str, steps: int = STEPS, *, merge: int = 1, clip: float = 0.0,
              model: torch.nn.Module | None = None, opt: Any = None, start: int = 0) -> dict[str, np.ndarray]:
    """One process, the global batch: what the sharded run must equal. ``merge``: k batches
    averaged per update (gradient merge); ``clip``: clip_grad_norm_ before each update."""
    model = model if model is not None else TinyLM()
    opt = opt if opt is not None else make_opt(opt_name, model.parameters())
    for update in range(start, steps):
        opt.zero_grad()
        for micro in range(merge):
            (loss_fn(model, global_batch(update * merge + micro)) / merge).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return state(model.state_dict())


def program(role: Any, opts: dict, opt_name: str) -> tuple[dict[str, np.ndarray], str]:
    """The program style: ``minimize`` over a fresh `TinyLM`, ``STEPS`` runs of ``main_program``
    on this rank's batches; the trained state and the program's listing."""
    from fleetlike import DistributedStrategy, Executor, fleet

    model = TinyLM()
    opt = fleet.distributed_optimizer(make_opt(opt_name, model.parameters()), DistributedStrategy.from_dict(opts))
    opt.minimize(loss_fn, model)
    exe = Executor()
    exe.run(fleet.startup_program)
    for step in range(STEPS):
        exe.run(fleet.main_program, feed=batch(step, role.rank, role.world_size))
    return state(fleet.full_state_dict(model)), str(fleet.main_program)

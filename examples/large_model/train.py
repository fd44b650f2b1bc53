#!/usr/bin/env python
"""A transformer language model trained with ZeRO stage 3: every rank keeps only its shard of
the weights, gradients and AdamW state (16/N bytes per parameter between steps instead of 16).

    python -m fleetlike.launch --nproc_per_node=2 --started_port=auto examples/large_model/train.py

STAGE=2 (or EPL's spelling, FLEETLIKE_STRATEGY='{"zero.level": "v1"}') shards gradients and
optimizer state only; STAGE=1 the optimizer state only. The loop is a plain PyTorch loop: your
optimizer, your scheduler. At the end every rank calls `fleet.full_state_dict` (the full
weights, for evaluation or export) and `fleet.save_persistables` (each rank writes its shard;
the checkpoint loads at another world size or stage).
"""
import os

import torch
import torch.nn.functional as F

from fleetlike import DistributedStrategy, fleet

VOCAB, DIM, HEADS, SEQ, BLOCKS = 256, 128, 4, 32, int(os.environ.get("BLOCKS", "6"))


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(DIM), torch.nn.LayerNorm(DIM)
        self.attn = torch.nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM, 4 * DIM), torch.nn.GELU(), torch.nn.Linear(4 * DIM, DIM))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class LM(torch.nn.Module):
    """Embedding, BLOCKS blocks (each sharded on its own), an output head tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.pos = torch.nn.Parameter(torch.zeros(SEQ, DIM))
        self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
        self.ln = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        mask = torch.triu(torch.full((SEQ, SEQ), float("-inf")), 1)
        x = self.embed(tokens) + self.pos
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))


def batch(g):
    """A toy language: each next token is the previous one plus one, modulo VOCAB."""
    start = torch.randint(0, VOCAB, (8, 1), generator=g)
    seq = (start + torch.arange(SEQ + 1)) % VOCAB
    return seq[:, :-1], seq[:, 1:]


strategy = DistributedStrategy()
strategy.sharding = True
strategy.sharding_configs = {"sharding_degree": 0, "stage": int(os.environ.get("STAGE", "3")),
                             "clip_norm": 1.0, "clip_after_allreduce": True}
torch.manual_seed(0)
fleet.init(strategy=strategy)                       # FLEETLIKE_STRATEGY, if set, overrides it
model = fleet.distributed_model(LM())
optimizer = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-3))
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100)

g = torch.Generator().manual_seed(fleet.worker_index())  # each worker its own data
for step in range(int(os.environ.get("STEPS", "60"))):
    x, y = batch(g)
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
    loss.backward()
    optimizer.step()
    scheduler.step()
    if step % 10 == 0 or step == int(os.environ.get("STEPS", "60")) - 1:
        print(f"[rank {fleet.worker_index()}] step {step} loss {loss.item():.4f}", flush=True)

held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
total = sum(p.numel() for p in model.parameters())  # a shard's numel() is its full tensor's
full = fleet.full_state_dict(model)                  # plain full tensors under the model's names
print(f"[rank {fleet.worker_index()}] holds {held} of {total} weights; full state: {len(full)} tensors", flush=True)
if fleet.is_first_worker():
    print("\n".join(str(a) for a in fleet.applied_strategy()), flush=True)
if os.environ.get("CKPT"):
    fleet.save_persistables(None, os.environ["CKPT"])  # every rank: each writes its shard
fleet.shutdown()

"""Model builders for the planner (``python -m fleetlike.plan --model bench.plan_models:mlp50m``).

Each is ``build(batch_size) -> (model, loss_fn, feed)`` (`fleetlike.plan.spec`): the three models
of ``bench/plan_accuracy.py``:

- ``mlp50m``: the 50 MB MLP of the other benchmarks (3 x Linear(2048, 2048), ReLU between),
  each layer in a Sequential of its own so that recompute's "auto" finds repeated blocks;
- ``convnet``: a small VGG-style conv net with BatchNorm on 32x32 images (~4.7 MB);
- ``transformer``: a 4-layer encoder, d_model 256, 4 heads, 64 tokens, vocabulary 2000 (~14 MB).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["convnet", "mlp50m", "transformer"]


def _xent(model: nn.Module, feed: dict[str, Any]) -> torch.Tensor:
    return F.cross_entropy(model(feed["x"]), feed["y"])


def mlp50m(batch_size: int) -> tuple[nn.Module, Any, dict[str, torch.Tensor]]:
    """The 50 MB MLP (12.6 M float32 parameters)."""
    torch.manual_seed(1234)
    model = nn.Sequential(nn.Sequential(nn.Linear(2048, 2048), nn.ReLU()), nn.Sequential(nn.Linear(2048, 2048), nn.ReLU()),
                          nn.Sequential(nn.Linear(2048, 2048)))
    g = torch.Generator().manual_seed(7)
    feed = {"x": torch.randn(batch_size, 2048, generator=g), "y": torch.randint(0, 2048, (batch_size,), generator=g)}
    return model, _xent, feed


def _block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                         nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                         nn.MaxPool2d(2))


def convnet(batch_size: int) -> tuple[nn.Module, Any, dict[str, torch.Tensor]]:
    """A conv net: three blocks of two 3x3 convolutions (32, 64, 128 channels), then a classifier."""
    torch.manual_seed(1234)
    model = nn.Sequential(nn.Sequential(_block(3, 32), _block(32, 64), _block(64, 128)),
                          nn.Sequential(nn.Flatten(), nn.Linear(128 * 4 * 4, 512), nn.ReLU(), nn.Linear(512, 10)))
    g = torch.Generator().manual_seed(7)
    feed = {"x": torch.randn(batch_size, 3, 32, 32, generator=g), "y": torch.randint(0, 10, (batch_size,), generator=g)}
    return model, _xent, feed


class TinyTransformer(nn.Module):
    """Token embedding + positions, ``layers`` encoder blocks, a tied-size output head."""

    def __init__(self, vocab: int = 2000, d: int = 256, heads: int = 4, layers: int = 4, seq: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos[: x.shape[1]]
        for blk in self.blocks:
            h = blk(h)
        return self.head(h)


def _lm(model: nn.Module, feed: dict[str, Any]) -> torch.Tensor:
    out = model(feed["x"])
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), feed["y"].reshape(-1))


def transformer(batch_size: int) -> tuple[nn.Module, Any, dict[str, torch.Tensor]]:
    """A small transformer language model (next-token targets on random tokens)."""
    torch.manual_seed(1234)
    model = TinyTransformer()
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, 2000, (batch_size, 65), generator=g)
    return model, _lm, {"x": x[:, :-1].contiguous(), "y": x[:, 1:].contiguous()}

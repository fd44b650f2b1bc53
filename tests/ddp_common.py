"""The exact-arithmetic model and batches of the DDP face's tests: integer data and 1/8-dyadic
weights keep every gradient sum exact in any order, so fleetlike's hook and plain DDP compare
with ``assert_array_equal``."""

from __future__ import annotations

import torch


def dyadic_model() -> torch.nn.Module:
    g = torch.Generator().manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 3))
    with torch.no_grad():
        for p in m.parameters():  # multiples of 1/8 in [-1, 1]: every sum of a few steps is exact
            p.copy_(torch.randint(-8, 9, p.shape, generator=g).float() / 8)
    return m


def dyadic_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randint(-2, 3, (4, 6), generator=g).float(),
            torch.randint(-2, 3, (4, 3), generator=g).float())

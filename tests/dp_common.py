"""Model, data and single-process references shared by the data-parallel tests."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import labelled_batch, max_diff, params  # noqa: F401 - max_diff, params: re-exported to the tests

IN, HID, OUT, BATCH = 16, 24, 3, 8


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.Tanh(), torch.nn.Linear(HID, OUT))


def make_opt(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1)
    if name == "momentum":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=0.01)


def batch(step: int, rank: int) -> dict[str, torch.Tensor]:
    return labelled_batch(step * 1009 + rank, BATCH, IN, OUT)


def loss_fn(model: torch.nn.Module, feed: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(feed["x"]), feed["y"])


def single_process(opt_name: str, world: int, steps: int, start: int = 0) -> list[np.ndarray]:
    """One process on the concatenated batch of all ranks, from rank 0's initial parameters."""
    model = make_model(100)
    opt = make_opt(opt_name, model)
    for step in range(start, steps):
        parts = [batch(step, r) for r in range(world)]
        feed = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        loss_fn(model, feed).backward()
        opt.step()
        opt.zero_grad()
    return params(model)


@contextlib.contextmanager
def torch_group(role, rendezvous_file: str) -> Iterator[None]:
    """torch.distributed's default gloo group over the same ranks (the DDP / SyncBatchNorm
    references), joined through a file the test owns: no port is chosen and handed over."""
    dist.init_process_group("gloo", init_method=f"file://{rendezvous_file}", rank=role.rank,
                            world_size=role.world_size)
    try:
        yield
        # gloo's worker threads idle before a DDP model (its Reducer) frees the group: freed while
        # a worker still drops the last backward's work, torch 2.13 deadlocks on the GIL
        # (tests/helpers.py says how); the sleep lets the workers take it and finish
        dist.barrier()
        time.sleep(0.05)
    finally:
        dist.destroy_process_group()

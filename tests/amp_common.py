"""The digits task (scikit-learn ships the data): a real dataset for convergence checks."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


#: a file of the raw digits arrays (`save_digits`): a process that finds it named here skips
#: scikit-learn's import (seconds of CPU per worker process)
DIGITS_FILE_ENV = "DIGITS_NPZ"


def _digits_raw() -> tuple[np.ndarray, np.ndarray]:
    path = os.environ.get(DIGITS_FILE_ENV)
    if path and os.path.exists(path):
        with np.load(path) as saved:
            return saved["x"], saved["y"]
    from sklearn.datasets import load_digits

    data = load_digits()
    return data.data, data.target


def save_digits(path: Path) -> Path:
    """Write the raw digits arrays to ``path`` (.npz) for `DIGITS_FILE_ENV`."""
    x, y = _digits_raw()
    np.savez(path, x=x, y=y)
    return path


def digits_split(seed: int = 0):
    raw_x, raw_y = _digits_raw()
    x = (raw_x / 16.0).astype("float32")
    y = raw_y.astype("int64")
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    return (torch.from_numpy(x[:1400]), torch.from_numpy(y[:1400])), (torch.from_numpy(x[1400:]), torch.from_numpy(y[1400:]))


def digits_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def digits_loss(model, feed):
    return F.cross_entropy(model(feed["x"]), feed["y"])


def accuracy(model, x, y) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def shard_batch(x, y, step: int, rank: int, world: int, batch: int = 32):
    n = len(x)
    start = (step * batch * world + rank * batch) % (n - batch)
    return {"x": x[start : start + batch], "y": y[start : start + batch]}

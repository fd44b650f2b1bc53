"""The digits task (scikit-learn ships the data): a real dataset for convergence checks."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def digits_split(seed: int = 0):
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.data / 16.0).astype("float32")
    y = data.target.astype("int64")
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

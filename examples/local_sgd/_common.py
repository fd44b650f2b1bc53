"""Model, data and loss shared by the local SGD examples (a small regression MLP)."""
import numpy as np
import torch
import torch.nn.functional as F


def mlp():
    """Two tanh layers; every rank builds it, the startup program makes it rank 0's."""
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def gen_data(rank, step):
    """This rank's batch: each rank sees different data, so local steps drift apart."""
    rng = np.random.default_rng(1000 * step + rank)
    x = rng.standard_normal((64, 16)).astype("float32")
    return {"x": x, "y": (x.sum(axis=1, keepdims=True) * 0.3).astype("float32")}


def loss_fn(model, feed):
    return F.mse_loss(model(feed["x"]), feed["y"])

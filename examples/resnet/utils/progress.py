"""What a person reads while the job runs, and what is left when it ends.

`Progress` prints a progress bar on an interactive terminal and, in a log file (the launcher's
``log/workerlog.N``), one plain line every ``--log_period`` steps: step, loss, learning rate,
samples/s (all workers), loss scale, and the time the step waited on data. `History` is the
record of the run (saved in every checkpoint, so a resumed run's curves are whole); `plot`
draws it. `topk_correct` counts the hits that `evaluate` sums over all workers.

Example:
    >>> bar = Progress(epoch, num_epochs, steps, log_period=10, samples_per_step=64)
    >>> bar.step(loss=0.7, lr=0.1, loss_scale=None, data_wait=0.001)
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

__all__ = ["History", "Progress", "plot", "topk_correct"]


def topk_correct(logits: torch.Tensor, labels: torch.Tensor, ks=(1, 5)) -> torch.Tensor:
    """``[hits@k for k in ks]`` (float64 counts; k is capped at the number of classes)."""
    top = logits.topk(min(max(ks), logits.shape[1]), dim=1).indices
    hit = top.eq(labels.view(-1, 1))
    return torch.tensor([hit[:, :k].any(dim=1).sum().item() for k in ks], dtype=torch.float64)


class Progress:
    """One epoch's progress output (see the module docstring)."""

    def __init__(self, epoch: int, num_epochs: int, steps: int, log_period: int, samples_per_step: int,
                 stream=None) -> None:
        self.epoch, self.num_epochs, self.steps = epoch, num_epochs, steps
        self.log_period, self.samples_per_step = log_period, samples_per_step
        self.stream = stream or sys.stdout
        self.bar = self.stream.isatty()
        self.done = 0
        self.loss_sum = 0.0
        self.wait = 0.0
        self.start = self._mark = time.perf_counter()
        self._mark_step = 0

    def step(self, loss: float, lr: float, loss_scale: float | None, data_wait: float) -> None:
        self.done += 1
        self.loss_sum += loss
        self.wait += data_wait
        if not (self.bar or self.done % self.log_period == 0 or self.done == self.steps):
            return
        now = time.perf_counter()
        rate = (self.done - self._mark_step) * self.samples_per_step / max(now - self._mark, 1e-9)
        self._mark, self._mark_step = now, self.done
        scale = "" if loss_scale is None else f" loss_scale {loss_scale:g}"
        head = f"epoch {self.epoch + 1}/{self.num_epochs} step {self.done}/{self.steps}"
        text = (f"{head} loss {loss:.4f} lr {lr:.5f} samples/s {rate:.1f}{scale} "
                f"data_wait {data_wait * 1000:.1f}ms")
        if self.bar:
            width = 20
            filled = width * self.done // max(self.steps, 1)
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}")
            if self.done == self.steps:
                self.stream.write("\n")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / max(self.done, 1)

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start


class History:
    """Epochs done and their figures; ``state_dict``/``load_state_dict`` so a checkpoint holds it."""

    def __init__(self) -> None:
        self.epochs: list[dict] = []

    @property
    def next_epoch(self) -> int:
        return len(self.epochs)

    def add(self, **figures) -> None:
        self.epochs.append(dict(figures))

    def state_dict(self) -> dict:
        return {"epochs": [dict(e) for e in self.epochs]}

    def load_state_dict(self, state: dict) -> None:
        self.epochs = [dict(e) for e in state["epochs"]]

    def save(self, path: str) -> None:
        with open(path, "w") as fh:
            json.dump(self.state_dict(), fh, indent=2)


def plot(history: History, path: str) -> None:
    """Loss (training, per epoch) and top-1/top-5 (validation) against the epoch, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [e["epoch"] + 1 for e in history.epochs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.plot(epochs, [e["train_loss"] for e in history.epochs], marker="o")
    left.set(xlabel="epoch", ylabel="training loss", title="loss")
    right.plot(epochs, [100 * e["top1"] for e in history.epochs], marker="o", label="top-1")
    right.plot(epochs, [100 * e["top5"] for e in history.epochs], marker="s", label="top-5")
    right.set(xlabel="epoch", ylabel="validation accuracy (%)", title="accuracy")
    right.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)

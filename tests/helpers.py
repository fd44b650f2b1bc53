"""Small pieces many test files need, written once: comparing parameter lists, seeded batches,
the two losses the tests train with. Rank functions import them by module name (tests/ is on
sys.path in the workers too), so they stay plain module-level functions."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from typing import TypeVar

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["PRELOAD_VARIABLES", "cross_entropy", "labelled_batch", "max_diff", "mse", "params", "preload_env",
           "regression_batch", "side_by_side"]

T = TypeVar("T")

#: the session's preload server (tests/conftest.py), kept by the helpers that otherwise clear
#: every FLEETLIKE_ variable from a launcher's environment
PRELOAD_VARIABLES = ("FLEETLIKE_PRELOAD", "FLEETLIKE_PRELOAD_SOCKET")


def preload_env() -> dict[str, str]:
    """The preload variables of this process's environment (the launchers' workers fork from the
    session's server; the test says so where it needs a plain start)."""
    return {k: os.environ[k] for k in PRELOAD_VARIABLES if k in os.environ}


def max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """The largest absolute difference between two lists of same-shaped arrays."""
    assert len(a) == len(b), (len(a), len(b))
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def params(model: torch.nn.Module) -> list[np.ndarray]:
    """The model's parameters as numpy copies."""
    return [p.detach().clone().numpy() for p in model.parameters()]


def labelled_batch(seed: int, rows: int, features: int, classes: int) -> dict[str, torch.Tensor]:
    """``x`` standard normal (float32) and ``y`` class labels, both from one seeded generator."""
    rng = np.random.default_rng(seed)
    return {"x": torch.from_numpy(rng.standard_normal((rows, features)).astype("float32")),
            "y": torch.from_numpy(rng.integers(0, classes, rows))}


def regression_batch(seed: int, rows: int, features: int, outputs: int, scale: float,
                     squash: bool = False) -> dict[str, torch.Tensor]:
    """``x`` standard normal and the target ``y = scale * x[:, :outputs]`` (through tanh with
    ``squash``): each rank's ``scale`` gives it a different optimum, so averaging matters."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, features)).astype("float32")
    head = np.tanh(x[:, :outputs]) if squash else x[:, :outputs]
    return {"x": torch.from_numpy(x), "y": torch.from_numpy((head * scale).copy())}


def cross_entropy(model: torch.nn.Module, feed: dict[str, torch.Tensor]) -> torch.Tensor:
    """The classification loss (in float32 even when the model's output is 16-bit under AMP)."""
    return F.cross_entropy(model(feed["x"]).float(), feed["y"])


def mse(model: torch.nn.Module, feed: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(feed["x"]), feed["y"])


# ---------------------------------------------------------------- jobs side by side
# (a test file's multi-process jobs that mostly wait, for a peer, a heartbeat or a timeout, run
# at once; each test then checks its own job's result)

@contextlib.contextmanager
def side_by_side(*waves: Mapping[str, Callable[[], T]]) -> Iterator[dict[str, Future[T]]]:
    """Run each wave's jobs at once, each in a thread of its own (a job is a function that starts
    processes and waits for them, bounded by its own timeouts), the waves one after the other
    (so that no more run at once than the machine keeps up with); yield every job's future by
    name. On exit, waits for every job: none outlives the block."""
    futures: dict[str, Future[T]] = {name: Future() for wave in waves for name in wave}

    def run(name: str, job: Callable[[], T]) -> None:
        futures[name].set_running_or_notify_cancel()
        try:
            futures[name].set_result(job())
        except BaseException as exc:  # noqa: BLE001 - the test that reads the result raises it
            futures[name].set_exception(exc)

    def drive() -> None:
        for wave in waves:
            threads = [threading.Thread(target=run, args=item, daemon=True) for item in wave.items()]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()

    driver = threading.Thread(target=drive, name="side-by-side", daemon=True)
    driver.start()
    try:
        yield futures
    finally:
        driver.join()

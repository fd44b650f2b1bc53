"""`Executor`: runs a `Program` on a feed and returns the fetched outputs, as Paddle's does.

Example:
    >>> exe = Executor(CPUPlace())
    >>> exe.run(fleet.startup_program)
    >>> loss, = exe.run(fleet.main_program, feed={"x": x, "y": y}, fetch_list=["loss"])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fleetlike.program.program import Program, fetch

__all__ = ["Executor", "CPUPlace", "CUDAPlace"]


def CPUPlace() -> torch.device:  # noqa: N802 - Paddle's spelling
    """Paddle's ``fluid.CPUPlace()``: the CPU device."""
    return torch.device("cpu")


def CUDAPlace(index: int) -> torch.device:  # noqa: N802 - Paddle's spelling
    """Paddle's ``fluid.CUDAPlace(i)``: CUDA device ``i``."""
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"CUDAPlace index={index!r} must be a non-negative int (a GPU id)")
    return torch.device("cuda", index)


class Executor:
    """Runs programs. ``place`` is where feeds go (default: the program's own device)."""

    def __init__(self, place: torch.device | str | None = None) -> None:
        self.place = torch.device(place) if place is not None else None

    def run(
        self,
        program: Program,
        feed: Mapping[str, Any] | None = None,
        fetch_list: Sequence[Any] | None = None,
        **_paddle_only: Any,
    ) -> list[Any]:
        """Run one step of ``program``; return the values named in ``fetch_list``.

        Feeds may be numpy arrays, tensors or numbers; they are moved to the device. Paddle's
        extra keywords (``use_program_cache`` ...) are accepted and have nothing to do here.
        """
        if not isinstance(program, Program):
            raise TypeError(
                f"Executor.run takes a fleetlike Program (fleet.main_program, "
                f"fleet._origin_program, fleet.startup_program), got {type(program).__name__}"
            )
        unknown = set(_paddle_only) - {"use_program_cache", "return_numpy", "scope"}
        if unknown:
            raise TypeError(f"Executor.run got unexpected keyword arguments {sorted(unknown)}")
        device = self.place or program.device
        state = program.run(_to_device(feed, device))
        return fetch(state, list(fetch_list) if fetch_list else None, program)


def _to_device(feed: Any, device: torch.device) -> Any:
    if feed is None:
        return None
    if isinstance(feed, torch.Tensor):
        return feed.to(device, non_blocking=True)
    if isinstance(feed, np.ndarray):
        return torch.from_numpy(feed).to(device)
    if isinstance(feed, Mapping):
        return {k: _to_device(v, device) for k, v in feed.items()}
    if isinstance(feed, (list, tuple)):
        return type(feed)(_to_device(v, device) for v in feed)
    return feed

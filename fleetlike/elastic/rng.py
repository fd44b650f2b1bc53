"""The random number generators a rank draws from, kept with each commit of an elastic `State`.

A rollback puts back the model, the optimizer and the values of the last commit; the dropout
masks, random augmentations and shuffles after it come from the process-wide generators, which
Horovod's ``TorchState`` does not keep: a survivor resumes with generators advanced past the
commit, a restarted worker with its freshly seeded ones, and the run after a failure draws other
numbers than the run without it. fleetlike keeps them too (an extension of Horovod's semantics):
each commit records, for every rank, torch's CPU generator, the CUDA generators when CUDA is
initialized, Python's ``random`` and NumPy's legacy global ``numpy.random`` (when NumPy is loaded);
a rollback gives rank ``r`` of the new world what rank ``r`` recorded. Generators a script creates
itself (``torch.Generator()``, ``numpy.random.default_rng()``) are not process-wide and are not
kept.

Example (what `State.commit` and `State.restore` do)::

    committed = gather(world)                  # every rank's generators, by rank
    ...
    restore(committed[world.rank])             # the draws after the commit, again
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch

from fleetlike.comm import Communicator, all_gather_ragged, dumps_signed, loads_signed

__all__ = ["capture", "gather", "restore"]

#: what the gathered payloads are signed for (`fleetlike.comm.secret`)
_CONTEXT = "elastic.rng"


def capture() -> dict[str, Any]:
    """This process's generators now: ``torch``, ``python``, and ``cuda`` / ``numpy`` where in use."""
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        out["numpy"] = numpy.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def restore(saved: dict[str, Any]) -> None:
    """Set the generators `capture` recorded; one it did not record keeps its state. CUDA
    generators are set for the devices both the recording and this process have."""
    torch.set_rng_state(saved["torch"])
    random.setstate(saved["python"])
    if "numpy" in saved:
        import numpy

        numpy.random.set_state(saved["numpy"])
    if "cuda" in saved and torch.cuda.is_available():
        for device, state in enumerate(saved["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, device)


def gather(world: Communicator, mine: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``mine`` (from `capture`), in rank order. Collective over ``world``; the
    payloads are pickled with the job's HMAC and checked before unpickling."""
    blob = dumps_signed(mine, _CONTEXT, world.rank)
    parts = all_gather_ragged(world, torch.frombuffer(bytearray(blob), dtype=torch.uint8))
    return [mine if r == world.rank else loads_signed(p.numpy().tobytes(), _CONTEXT, r)  # type: ignore[misc]
            for r, p in enumerate(parts)]

"""The bytes autograd keeps saved for backward, live, during a real run, and their peak.

`fleetlike.plan.memory.activation_bytes` counts what one forward saves; a pipeline holds the
activations of several micro-batches at once, as many as its schedule keeps in flight, so
checking the planner against a real job needs the live total over a whole step. Wrap each
block of the model in `Metered` (its forward runs under the meter's saved-tensor hooks), turn
the meter on, run the step, read ``peak``.

Each saved tensor is counted per storage (a storage saved twice counts once) from when autograd
saves it until autograd drops it: the hook hands autograd a small holder object, which the graph
keeps exactly as long as it needs the tensor, and the holder's finalizer releases the count (the
tensor object itself may die sooner, as a view, or live longer, held by the caller), also for a
graph dropped without a backward. Parameters and the storages named in ``params`` are left out.

Example:
    >>> meter = SavedBytesMeter()
    >>> net = torch.nn.Sequential(*[Metered(b, meter) for b in blocks])
    >>> meter.params = {p.untyped_storage().data_ptr() for p in net.parameters()}
    >>> meter.enabled = True; step(); meter.peak
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

__all__ = ["Metered", "SavedBytesMeter"]


class _Saved:
    """What autograd keeps for one saved tensor while the meter is on."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedBytesMeter:
    """Live bytes of the tensors autograd saved (per storage, parameters left out) and their peak."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.refs: dict[int, int] = {}
        self.peak = 0
        self.lock = threading.Lock()
        #: bumped by `reset`: a tensor saved before it is released without touching the new counts
        self.epoch = 0
        #: storages (``untyped_storage().data_ptr()``) not counted: parameters, the caller's batch
        self.params: set[int] = set()
        #: off while steps are timed (the hooks cost Python time per saved tensor)
        self.enabled = False

    def pack(self, t: torch.Tensor) -> Any:
        if not self.enabled or isinstance(t, torch.nn.Parameter) or t.untyped_storage().data_ptr() in self.params:
            return t
        key = t.untyped_storage().data_ptr()
        with self.lock:
            self.refs[key] = self.refs.get(key, 0) + 1
            self.live[key] = t.untyped_storage().nbytes()
            self.peak = max(self.peak, sum(self.live.values()))
            epoch = self.epoch
        # a detached alias (same storage, no grad_fn): an op that saves its own output (ReLU,
        # sigmoid) would otherwise hold, through the holder, the tensor whose grad_fn holds the
        # holder, a cycle through C++ that no collector frees when the graph is dropped unused
        saved = _Saved(t.detach())
        weakref.finalize(saved, self._drop, key, epoch)
        return saved

    @staticmethod
    def unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def reset(self) -> None:
        """Forget what was saved so far and start a new peak."""
        with self.lock:
            self.epoch += 1
            self.peak = 0
            self.live.clear()
            self.refs.clear()

    def _drop(self, key: int, epoch: int) -> None:
        with self.lock:
            # saved before the last reset: that storage may be counted again since, by a new save
            if epoch != self.epoch or key not in self.refs:
                return
            self.refs[key] -= 1
            if not self.refs[key]:
                del self.refs[key], self.live[key]


class Metered(torch.nn.Module):
    """A block whose forward runs under the meter's saved-tensor hooks (its parameters and
    ``state_dict`` are the block's, under the prefix ``block.``)."""

    def __init__(self, block: torch.nn.Module, meter: SavedBytesMeter) -> None:
        super().__init__()
        self.block, self.meter = block, meter

    def forward(self, x: Any) -> Any:
        with torch.autograd.graph.saved_tensors_hooks(self.meter.pack, self.meter.unpack):
            return self.block(x)

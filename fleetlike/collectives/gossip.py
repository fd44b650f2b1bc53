"""Gossip (down-sampling) compression: each step averages one of every ``n`` gradient elements.

AIACC's ``PERSEUS_DOWNSAMPLE_N_ELEMENTS``: a bucket of ``S`` elements sends ``ceil(S / n)`` of
them per step, the elements ``offset, offset + n, offset + 2n, ...`` with an offset that rotates
every step (``offset = step % n``), so every element crosses the network once every ``n`` steps.
Nothing is dropped: **error feedback** keeps what was not sent in a residual that is added to the
next step's gradient, so an element that travels at step ``t`` carries the sum of its local
gradients since it last travelled. Per step the traffic is ``1/n`` of the uncompressed path; the
update of each element is delayed by up to ``n - 1`` steps, which large-batch training tolerates
(AIACC reports ImageNet/ResNet-50 accuracy kept for n = 2, 4, 8).

After the averaging a bucket holds the averaged sent elements and zeros elsewhere (those parts
wait in the residual), so the optimizer sees the average of every rank's accumulated gradient,
delivered in strides.

`Downsampler` is the state (residuals, step counters; picklable for checkpoints) and the two pure
halves of a step, shared by `DownsampledAllReduce` (fleetlike's reducer, both styles) and the DDP
communication hook of `fleetlike.ddp`.

Example:
    >>> coll = DownsampledAllReduce(FlatAllReduce([world]), n=4)
    >>> coll.start(bucket).wait()   # a quarter of bucket.buffer averaged, the rest kept locally
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from typing import Any, Protocol

import torch

from fleetlike.collectives.buckets import Bucket
from fleetlike.comm import Communicator, Work
from fleetlike.comm.handles import ChainedWork

__all__ = ["Downsampler", "DownsampledAllReduce", "sent_elements"]


def sent_elements(numel: int, n: int, offset: int) -> int:
    """How many of ``numel`` elements a step with ``offset`` sends (``len(range(offset, numel, n))``)."""
    return len(range(offset, numel, n))


class Downsampler:
    """Residuals and step counters of gossip compression, one entry per bucket key.

    ``encode`` adds the residual, picks this step's elements and keeps the rest as the new
    residual; ``decode`` writes the averaged elements back into a zeroed buffer. A key's buffer
    must keep its size (a bucket layout never changes under one key; a change is an error).
    Thread safe: keys of different buckets may be encoded from different threads."""

    def __init__(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n={n!r}: gossip sends one of every n elements; n must be an int >= 1")
        self.n = n
        self._lock = threading.Lock()
        self.residuals: dict[Hashable, torch.Tensor] = {}
        self.steps: dict[Hashable, int] = {}
        self._index: dict[tuple[Any, ...], torch.Tensor] = {}

    def encode(self, key: Hashable, flat: torch.Tensor, step: int | None = None,
               sizes: Sequence[int] | None = None) -> tuple[torch.Tensor, Any]:
        """``(elements to average, where)`` for ``flat`` (1-D); ``flat`` is left holding the
        gradient plus residual, the residual holds it minus the elements sent. The offset is
        ``step % n``; ``step=None`` counts this key's own calls (the same on every rank).
        ``sizes`` (the numels of the tensors packed in ``flat``) strides each tensor on its own,
        so the elements sent do not depend on how tensors are packed into buckets."""
        with self._lock:
            res = self.residuals.get(key)
            if step is None:
                step = self.steps.get(key, 0)
                self.steps[key] = step + 1
            if res is None:
                res = self.residuals[key] = torch.zeros_like(flat)
        if res.shape != flat.shape or res.dtype != flat.dtype:
            raise ValueError(
                f"gossip bucket {key!r} changed from {tuple(res.shape)} {res.dtype} to "
                f"{tuple(flat.shape)} {flat.dtype}; the residual of a bucket must keep its layout "
                "(build the buckets once, before the first compressed step)"
            )
        offset = step % self.n
        where: Any = slice(offset, None, self.n) if sizes is None else self._positions(tuple(sizes), offset, flat.device)
        flat.add_(res)
        res.copy_(flat)
        sent = flat[where].clone(memory_format=torch.contiguous_format)  # never a view of flat
        res[where] = 0
        return sent, where

    def _positions(self, sizes: tuple[int, ...], offset: int, device: torch.device) -> torch.Tensor:
        """`_positions`, built once per layout and offset (n index tensors per bucket)."""
        key = (sizes, offset, str(device))
        with self._lock:
            found = self._index.get(key)
            if found is None:
                found = self._index[key] = _positions(sizes, offset, self.n, device)
        return found

    def decode(self, flat: torch.Tensor, sent: torch.Tensor, where: Any) -> torch.Tensor:
        """``flat`` <- zeros with the averaged ``sent`` elements at their places."""
        flat.zero_()
        flat[where] = sent
        return flat

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"n": self.n, "residuals": {k: v.clone() for k, v in self.residuals.items()},
                    "steps": dict(self.steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["n"]) != self.n:
            raise ValueError(f"a gossip state saved with n={state['n']} cannot be loaded with n={self.n}")
        with self._lock:
            self.residuals = {k: v.clone() for k, v in state["residuals"].items()}
            self.steps = dict(state["steps"])


def _positions(sizes: Sequence[int], offset: int, n: int, device: torch.device) -> torch.Tensor:
    """Indices of elements ``offset, offset + n, ...`` of each tensor packed back to back."""
    parts, start = [], 0
    for size in sizes:
        if offset < size:
            parts.append(torch.arange(start + offset, start + size, n, device=device))
        start += size
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)


class _Inner(Protocol):
    @property
    def world(self) -> Communicator: ...

    def start_tensor(self, tensor: torch.Tensor, index: int) -> Work: ...

    def describe(self, bucket: Bucket) -> dict[str, Any]: ...


class DownsampledAllReduce:
    """A `BucketCollective`: gossip compression around any averaging collective (``inner``:
    flat, hierarchical or 16-bit), which averages only the sent elements."""

    def __init__(self, inner: _Inner, n: int) -> None:
        self.inner = inner
        self.sampler = Downsampler(n)

    @property
    def world(self) -> Communicator:
        return self.inner.world

    def start(self, bucket: Bucket) -> Work:
        return self.start_tensor(bucket.buffer, bucket.index)

    def start_tensor(self, tensor: torch.Tensor, index: int) -> Work:
        flat = tensor.view(-1)
        sent, where = self.sampler.encode(index, flat)
        work = self.inner.start_tensor(sent, index)
        return ChainedWork(work, lambda: self.sampler.decode(flat, sent, where))

    def describe(self, bucket: Bucket) -> dict[str, Any]:
        d = dict(self.inner.describe(bucket))
        d["gossip"] = f"1/{self.sampler.n} of the elements per step, rotating, error feedback"
        return d

"""Transient gradient buckets (ZeRO stage 2 on the stage 1 engine): a rank keeps only its own shard.

Stage 1 (`fleetlike.collectives.sharded`) keeps every gradient bucket for good: the
parameters' ``.grad`` are views into it, so every rank holds the whole gradient (4 bytes per
fp32 parameter) although it steps only its partition. Stage 2 moves exactly the same bytes (the
same buckets, owners and collectives) but holds a bucket only while it is needed:

1. the bucket's buffer is allocated, unfilled, when its first gradient of a communicating
   backward lands (`TransientBucket.materialise`; from 32 MiB on in transparent huge pages,
   `fleetlike.collectives.hugepages`, since glibc maps a block that large fresh every step): each gradient is copied in as it lands
   (autograd hands it over: nothing is added into zeros), the segments' padding is zeroed and a
   parameter that got no gradient reads zeros at the launch; a bucket of one parameter adopts
   the gradient autograd made instead, no copy;
2. it is reduce-scattered (on gloo: allreduced, each rank reading its segment) when full; an
   average is summed, and divided on the segment this rank keeps only (`release`);
3. once that is done (`TransientBucket.release`) this rank's segment is copied (divided) into
   the shard it keeps, its own parameters' ``.grad`` become views into that shard, the others'
   are set to None, and the buffer is dropped.

A bucket of several parameters wholly owned by this rank is its shard: it stays allocated for
good, exactly as at stage 1. A bucket of one parameter this rank owns adopts its gradient too,
and that gradient is the shard kept. Between steps the kept shards read zero (as after
``zero_grad``); while a shard is still those zeros (its version counter unchanged) a
communicating backward starts with its parameters' ``.grad`` None (`lift_zero_kept`), so their
gradients land as the others' do and the zeros are neither copied into the bucket nor, for a
one-parameter bucket, held beside the gradient being made. So a rank keeps ``1/N`` of the
gradients; at most `IN_FLIGHT` buckets are being reduced beside the one filling
(`TransientReducer` waits for the oldest before it allocates another), so the transient memory
is a few buckets, whatever the model's size.

Outside a communicating backward (``no_sync``, gradient-merge micro-steps) nothing is reduced:
the gradients of the parameters this rank does not own are held whole, as autograd makes them
(the owned ones accumulate in the kept shard), and the next communicating backward folds them
into its buckets. Gradient merge thus holds full gradients during the micro-steps and
communicates once per window, as at stage 1 (reduce-scattering every micro-step would keep
``1/N`` but multiply the traffic by k, the opposite of what merge is for).

Example:
    >>> buckets = plan_shards(params, 32 << 20, world.size, make=transient_buckets(world.rank))
    >>> reducer = TransientReducer(params, ShardReduceScatter(world.rank, [world]), cap_bytes=None,
    ...                            buckets=buckets)
    >>> reducer.prepare(loss); loss.backward()   # each rank: its own parameters' reduced .grad
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fleetlike.collectives.hugepages import empty_transient
from fleetlike.collectives.reducer import GradReducer
from fleetlike.collectives.sharded import ShardedBucket
from fleetlike.comm import divide_

__all__ = ["IN_FLIGHT", "TransientBucket", "TransientReducer", "transient_buckets"]

#: buckets being reduced at once besides the one filling: the next bucket waits for the oldest
#: to be released first when more would be live. One is enough to keep the link busy (the
#: collectives of one ring run one after the other anyway: while bucket k is reduced, backward
#: fills k + 1, and k + 2 waits for k), and bounds the transient memory to two buckets. (Waiting
#: for bucket k before k + 1 fills, as an earlier version did, left none in flight: at 8.4M
#: parameters on 2 gloo ranks stage 2's backward stalled on each collective; docs/BENCHMARKS.md)
IN_FLIGHT = 1


class TransientBucket(ShardedBucket):
    """A `ShardedBucket` whose buffer exists only while it is filled and reduced (see the module
    docstring). ``kept`` is what this rank keeps of it: the whole buffer when it owns the whole
    bucket (``resident``: allocated for good, a stage 1 bucket), its segment's gradients for a
    segmented bucket with parameters of its own, else None; ``kept_views`` its parameters'
    gradients in it, by index into ``params``."""

    def __init__(self, index: int, params: Sequence[torch.nn.Parameter], owners: Sequence[int],
                 positions: Sequence[int], why: str | None = None, *, rank: int) -> None:
        self.rank = rank
        whole = bool(owners) and all(r == rank for r in owners)
        #: this rank owns the bucket's one parameter: its gradient, adopted from autograd as it
        #: lands, is the bucket and, once reduced, the shard kept (no resident buffer that
        #: autograd's gradient is added into: one gradient less in memory while it is made)
        self.adopts = whole and len(params) == 1
        self.resident = whole and not self.adopts
        super().__init__(index, params, owners, positions, why, allocate=self.resident)
        self.live = self.resident
        self.kept: torch.Tensor | None = None
        self.kept_views: dict[int, torch.Tensor] = {}
        #: the collective summed and left the division by the ranks' count to `release`, which
        #: divides this rank's segment only, as it copies it out (1: nothing left to divide)
        self.divide_on_release = 1
        if self.resident:
            self.kept = self.buffer
            self.kept_views = dict(enumerate(self.views))
        elif self.adopts:
            self.kept = torch.zeros_like(params[0], memory_format=torch.contiguous_format)
            self.kept_views = {0: self.kept}
        elif self.single is None and self.owned(rank):
            self.kept = torch.zeros(self.segment, dtype=self.dtype, device=self.device)
            base = self.positions[rank] * self.segment
            for j in self.owned(rank):
                o, p = self.offsets[j], self.params[j]
                self.kept_views[j] = self.kept[o - base : o - base + p.numel()].view_as(p)
        self._placeholder = self.buffer if not self.resident else torch.zeros(0, dtype=self.dtype, device=self.device)
        #: the kept shard's version counter when it was last zeroed (-1: not known to be zero)
        self._zeroed_at = self.kept._version if self.kept is not None and not self.resident else -1
        #: (start, end) of each segment's padding in the buffer: zeroed at every allocation
        self._pads: list[tuple[int, int]] = []
        if self.single is None:
            fill = [0] * len(self.positions)
            for p, r in zip(self.params, self.owners):
                fill[r] += p.numel()
            for r, used in enumerate(fill):
                if used < self.segment:
                    base = self.positions[r] * self.segment
                    self._pads.append((base + used, base + self.segment))

    @property
    def kept_bytes(self) -> int:
        return 0 if self.kept is None else self.kept.numel() * self.kept.element_size()

    def materialise(self) -> None:
        """Allocate the buffer, unfilled, and make the ``.grad`` of every parameter that holds
        one so far (a micro-step's local sum, a kept shard's) its view, with that gradient
        copied in; the others stay None until theirs lands, when the reducer copies it in
        (`GradReducer._fold`), or until the bucket is launched, when a parameter that got none
        reads zeros (`TransientReducer._launch`). So nothing is written twice: no memset of
        the whole bucket before the gradients that overwrite it (at 8.4M parameters on 2
        ranks, 24 MiB a bucket, that memset and autograd's add into the zeros were a tenth of
        the backward). Only the segments' padding, which the collective sends, is zeroed. A
        bucket of one parameter whose gradient is a tensor of its own adopts it."""
        if self.live:
            return
        if len(self.params) == 1 and self.single is not None:
            g = self.params[0].grad
            if (g is not None and not g.is_sparse and g.is_contiguous() and g.dtype == self.dtype
                    and g.device == self.device and g.storage_offset() == 0
                    and g.untyped_storage().nbytes() == g.numel() * g.element_size()):
                self.buffer = g.view(-1)
                self.views = [g]
                self.live = True
                return
        self.buffer = empty_transient(self.numel, self.dtype, self.device)
        self.views = [self.buffer[o : o + p.numel()].view_as(p) for o, p in zip(self.offsets, self.params)]
        self.live = True
        for lo, hi in self._pads:
            self.buffer[lo:hi].zero_()
        # the kept shard untouched since it was zeroed (its version counter, which every
        # in-place write through any of its views bumps, autograd's accumulation included):
        # its zeros need no copy, those parameters' gradients land like the others'
        zeros = self.kept is not None and self.kept._version == self._zeroed_at
        for j, (p, view) in enumerate(zip(self.params, self.views)):
            g = p.grad
            if g is None:
                continue
            if zeros and g is self.kept_views.get(j):
                p.grad = None
                continue
            view.copy_(g.to_dense() if g.is_sparse else g)
            p.grad = view

    def lift_zero_kept(self) -> None:
        """Before a communicating backward: while the kept shard is still the zeros it was set
        to (its version counter unchanged), this rank's parameters' ``.grad`` are None rather
        than views into it, so autograd hands their gradients over as it does the others'
        instead of adding them into zeros that `materialise` would then copy into the bucket."""
        if self.live or self.kept is None or self.kept._version != self._zeroed_at:
            return
        for j, view in self.kept_views.items():
            p = self.params[j]
            if p.grad is view:
                p.grad = None
        if self.adopts and self.params[0].grad is None:  # its zeros go: the gradient made next is the shard
            self.kept = None
            self.kept_views = {}

    def fill_missing(self) -> None:
        """Before the collective: the views of parameters whose gradient never landed (unused
        this backward) read zeros, the others' hold the copies; every ``.grad`` is its view."""
        for p, view in zip(self.params, self.views):
            if p.grad is not view:
                GradReducer._fold(p, view)

    def release(self) -> None:
        """After the bucket's collective: keep this rank's segment, drop the rest (see the
        module docstring). A deferred division (`divide_on_release`) is done here on the
        segment kept only, in the same pass as its copy out."""
        if self.resident or not self.live:
            return
        n, self.divide_on_release = self.divide_on_release, 1
        if self.adopts:
            if n != 1:
                divide_(self.buffer, n)
            self.kept = self.buffer.view_as(self.params[0])
            self.kept_views = {0: self.kept}
        elif self.kept is not None:
            if n != 1 and self.kept.is_floating_point():
                torch.div(self.segment_of(self.rank), n, out=self.kept)
            else:
                self.kept.copy_(self.segment_of(self.rank))
                divide_(self.kept, n)
        for j, p in enumerate(self.params):
            p.grad = self.kept_views.get(j)
        self.buffer = self._placeholder
        self.views = []
        self.live = False

    def discard(self) -> None:
        """Drop the buffer of a backward that stopped before this bucket was reduced (a
        non-finite gradient): the bucket is no longer live, so the next backward allocates a
        fresh one instead of accumulating into this one. The parameters' ``.grad`` stay what
        they were (views into the dropped buffer, which they keep alive), as a stage 1 bucket's
        would: a ``zero_grad`` clears them, a backward without one folds them in."""
        if self.resident or not self.live:
            return
        self.buffer = self._placeholder
        self.views = []
        self.live = False
        self.divide_on_release = 1

    def attach(self) -> None:
        """This rank's parameters' ``.grad`` are their views into the kept shard again (a
        replaced gradient folded in); the others' are left as they are (None, or a local sum
        that the next communicating backward folds in)."""
        if self.live:
            super().attach()
            return
        for j, view in self.kept_views.items():
            p = self.params[j]
            g = p.grad
            if g is view:
                continue
            if g is not None:
                view.copy_(g.to_dense() if g.is_sparse else g)
            p.grad = view

    def zero_kept(self) -> None:
        """Zero the kept shard, remembering its version (`materialise` then skips copying it)."""
        if self.kept is not None:
            self.kept.zero_()
            self._zeroed_at = self.kept._version

    def zero_(self) -> None:
        self.zero_kept()
        if self.live and not self.resident:
            self.buffer.zero_()


def transient_buckets(rank: int) -> Callable[..., TransientBucket]:
    """`plan_shards`' ``make`` for this rank's transient buckets."""

    def make(index: int, params: Sequence[torch.nn.Parameter], owners: Sequence[int], positions: Sequence[int],
             why: str | None = None) -> TransientBucket:
        return TransientBucket(index, params, owners, positions, why, rank=rank)

    return make


class TransientReducer(GradReducer):
    """A `GradReducer` over `TransientBucket` s: each bucket materialised at its first gradient,
    released once reduced, at most ``in_flight`` being reduced at once (module docstring)."""

    def __init__(self, params: Any, collective: Any, *, buckets: Sequence[TransientBucket],
                 in_flight: int = IN_FLIGHT, **kwargs: Any) -> None:
        if in_flight < 1:
            raise ValueError(f"in_flight={in_flight}: at least one bucket must be allowed in flight")
        self.in_flight = in_flight
        #: indices of the buckets launched and not yet released, oldest first
        self._launched: list[int] = []
        #: indices of the buckets materialised and not launched yet (filling)
        self._live_unlaunched: set[int] = set()
        super().__init__(params, collective, cap_bytes=None, buckets=buckets, **kwargs)
        if self.hold is not None:
            raise ValueError("transient buckets are reduced as backward fills them: there is no whole local "
                             "gradient to hold (clip after the reduction instead)")

    def _stop(self) -> None:
        # the buckets launched are waited for and released (their segments kept, as at the end of
        # a backward); the ones allocated and not launched (the bucket that raised, those filling)
        # are dropped: left live, the next backward would accumulate into them (and raise again
        # on a rank that does not own them, while the owner, whose bucket zero_grad cleared,
        # launches it: the ranks' collectives would no longer pair)
        super()._stop()
        while self._launched:
            self._retire(self._launched.pop(0))
        for b in self.buckets:
            assert isinstance(b, TransientBucket)
            b.discard()
        self._live_unlaunched.clear()

    def _prepare(self, roots: Any) -> None:
        super()._prepare(roots)
        for b in self.buckets:
            assert isinstance(b, TransientBucket)
            b.lift_zero_kept()

    def _make_room(self) -> None:
        # called as a new bucket is about to fill: at most ``in_flight`` + 1 transient buckets
        # live at once, those being reduced and those filling (one, when the gradients come in
        # bucket order): the oldest reduced ones are waited for until the new one fits (a
        # test of ``>= in_flight`` alone would leave none in flight, and backward would stall
        # on each bucket's collective before the next one fills)
        filling = sum(1 for i in self._live_unlaunched if self.buckets[i].live)
        while self._launched and len(self._launched) + filling >= self.in_flight + 1:
            self._retire(self._launched.pop(0))

    def _retire(self, index: int) -> None:
        work = self._works[index]
        if work is not None:
            started = time.perf_counter()
            work.wait()
            self.wait_seconds += time.perf_counter() - started
            self._works[index] = None
        bucket = self.buckets[index]
        assert isinstance(bucket, TransientBucket)
        bucket.release()

    def _grad_ready(self, p: torch.Tensor) -> None:
        if self.armed:
            bucket, _ = self._where[id(p)]
            assert isinstance(bucket, TransientBucket)
            if not bucket.live:
                self._make_room()
                bucket.materialise()
                self._live_unlaunched.add(bucket.index)
        super()._grad_ready(p)

    def _launch(self, bucket: Any) -> None:
        if not bucket.live:  # parameters that got no gradient this backward: zeros (or a local sum)
            self._make_room()
            bucket.materialise()
        self._live_unlaunched.discard(bucket.index)
        if not bucket.resident:
            bucket.fill_missing()
            defers = getattr(self.collective, "defers_division", None)
            if defers is not None and defers(bucket):  # summed: release divides the segment kept
                bucket.divide_on_release = self.collective.divide
        super()._launch(bucket)
        if not bucket.resident:
            self._launched.append(bucket.index)

    def _finalize(self) -> None:
        if not self.armed:
            return
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        for b in self.buckets:
            if b.resident and self._works[b.index] is not None:
                started = time.perf_counter()
                self._works[b.index].wait()  # type: ignore[union-attr]
                self.wait_seconds += time.perf_counter() - started
                self._works[b.index] = None
        while self._launched:
            self._retire(self._launched.pop(0))
        self.armed = False
        self._agree_finite()

    def _attach(self, keep: bool = True) -> None:
        if keep:
            for b in self.buckets:
                b.attach()
            return
        for b in self.buckets:
            assert isinstance(b, TransientBucket)
            if b.resident:
                for p, view in zip(b.params, b.views):
                    if p.grad is not view:
                        p.grad = view
            else:
                for j, p in enumerate(b.params):
                    p.grad = b.kept_views.get(j)

    def zero_grad(self) -> None:
        """The kept shards zeroed in place (unless `mark_zeroed` vouches for them) and attached;
        every other gradient None."""
        with self._lock:
            if self.stopped:
                self._stop()
            zeroed, self._zeroed = self._zeroed, False
            for b in self.buckets:
                assert isinstance(b, TransientBucket)
                if not zeroed and b.kept is not None:
                    b.zero_kept()
            self._attach(keep=False)

    def fold(self) -> None:
        """Refused: a transient bucket exists only while it is reduced (its gradients are folded
        in as it is allocated, `TransientBucket.materialise`), so there is no resident view to fold."""
        raise RuntimeError("transient (stage 2) buckets fold each gradient as the bucket is allocated; "
                           "there is no resident bucket to fold between steps")

    def rebucket(self, cap_bytes: int | None, collective: Any) -> None:
        raise RuntimeError("transient (stage 2) buckets are laid out once per owner; they cannot be re-bucketed "
                           "between steps (auto_tune tunes data parallel's buckets)")

    def grad_buffers(self) -> list[torch.Tensor]:
        """The gradients this rank holds after a communicating backward: its kept shards."""
        return [b.kept for b in self.buckets if isinstance(b, TransientBucket) and b.kept is not None]

    def transient_bytes(self) -> int:
        """The most bytes of buckets alive at once beyond the kept shards: ``in_flight`` being
        reduced and one filling, of the largest transient buckets (what the planner counts)."""
        # a bucket of one parameter this rank owns is not counted: its gradient is the shard
        # kept, whose zeros it replaces (`lift_zero_kept`)
        sizes = sorted((b.nbytes for b in self.buckets if not b.resident and not b.adopts), reverse=True)
        return sum(sizes[: self.in_flight + 1])

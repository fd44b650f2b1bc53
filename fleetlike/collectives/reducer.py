"""The data-parallel machinery: gradient hooks start each bucket's collective during backward.

`GradReducer` is armed before a communicating backward (``prepare``): by the program style in
``main_program``'s backward op, by the eager style at the end of the wrapped model's training
forward. Unarmed, the hooks do nothing, which is how ``no_sync``, gradient-merge micro-steps and
``_origin_program`` stay local. Once armed, the first gradient queues a callback at the end of
the backward that waits for every bucket (as DDP does), so whatever reads ``.grad`` after
``loss.backward()`` sees averaged gradients, a plain torch optimizer included.

Buckets launch strictly in index order on every rank (a bucket that is ready early waits for
its predecessors), as DDP does: gloo and NCCL match collectives by the order they are issued,
so this is what keeps ranks from pairing different buckets. A bucket holding a parameter that got
no gradient this step is launched when the step is finalized (its gradient is zero), so unused
parameters delay the overlap but never hang the job; with ``find_unused_parameters`` they are
found from the autograd graph before backward, so overlap is kept.

The collective itself is a `BucketCollective`: the default averages over one or more rings;
hierarchical, compressed and scaled variants plug in here without touching the hooks.

A reducer with a ``gate`` (a `PassGate`: Horovod's optimizer) arms itself: at the first gradient
of each backward its hook asks the gate whether that backward communicates (the k-th of an
`Accumulation` window), and at the end of the backward it lets the gate act while the buckets
are in flight, sends zeros for parameters without gradient, waits, and tells the gate. Its hook
is then the only gradient hook on each parameter. With ``sparse=True`` the gradients are not
made bucket views before a parameter's first gradient, so a sparse one shows: it is reduced
densely in its bucket and `restore_sparse` hands it back sparse.

Example:
    >>> reducer = make_reducer(model, FlatAllReduce([world]), cap_bytes=32 << 20)
    >>> reducer.prepare(loss); loss.backward(); reducer.finalize()   # grads averaged
"""

from __future__ import annotations

import threading
import time

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch

from fleetlike.collectives.buckets import Bucket, non_finite, plan_buckets
from fleetlike.collectives.finite import agree_finite
from fleetlike.collectives.flat import BucketCollective
from fleetlike.comm import Communicator, Work

__all__ = ["GradReducer", "PassGate", "make_reducer", "unused_parameters"]


def unused_parameters(
    roots: torch.Tensor | Sequence[torch.Tensor], params: Iterable[torch.nn.Parameter]
) -> list[torch.nn.Parameter]:
    """Parameters that ``roots`` (the loss, or a model's outputs) do not depend on, found by
    walking their autograd graph."""
    seen: set[int] = set()
    reached: set[int] = set()
    tops = [roots] if isinstance(roots, torch.Tensor) else list(roots)
    stack: list[Any] = [t.grad_fn for t in tops if t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        var = getattr(fn, "variable", None)
        if var is not None:
            reached.add(id(var))
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return [p for p in params if id(p) not in reached]


class PassGate(Protocol):
    """The owner of a reducer that arms itself (``GradReducer(gate=...)``)."""

    def begin_pass(self) -> bool:
        """The first gradient of a backward arrived: True when this backward communicates (it
        may raise, which stops the backward)."""
        ...

    def before_wait(self) -> None:
        """End of a communicating backward, every bucket started: what overlaps the transfers."""
        ...

    def after_wait(self) -> None:
        """Every bucket of that backward is reduced."""
        ...


class GradReducer:
    """Averages gradients over the ranks, overlapping communication with backward.

    Args:
        params: the model's parameters (those with ``requires_grad``).
        collective: how a bucket is combined (`FlatAllReduce` or a hierarchical/compressed one).
        cap_bytes: bucket size cap (``fuse_grad_size_in_MB``); None = one bucket per gradient.
        find_unused: look for parameters without gradient before each backward.
        gate: arm at the first gradient of a backward when ``gate.begin_pass()`` says so, and
            finalize at its end (see the module docstring); None: the owner calls `prepare`.
        sparse: learn which parameters get sparse gradients (their first one) and hand them
            back sparse (`restore_sparse`).
        lock: the owner's lock, when its gate and the reducer's per-step state change together.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        collective: BucketCollective,
        *,
        cap_bytes: int | None,
        find_unused: bool = False,
        check_nan_inf: bool = False,
        names: dict[int, str] | None = None,
        buckets: Sequence[Bucket] | None = None,
        hold: Callable[[], None] | None = None,
        gate: PassGate | None = None,
        sparse: bool = False,
        lock: threading.RLock | None = None,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.check_nan_inf = check_nan_inf
        self._names = names or {}
        self.collective = collective
        self.find_unused = find_unused
        #: seconds this process spent inside communication calls (starting buckets, waiting for
        #: them): the slow-rank report leaves them out of a rank's own work
        self.wait_seconds = 0.0
        self._callback_queued = False
        #: hooks may run on autograd's device threads while the training thread prepares or
        #: finalizes: the per-step state (pending counts, next bucket, handles, counters) is
        #: changed under this lock only (re-entrant: finalize launches what is left)
        self._lock = lock or threading.RLock()
        self.gate = gate
        #: a backward is running whose first gradient the gate has seen
        self._in_pass = False
        #: parameters whose first gradient is still to come (``sparse``): not bucket views yet
        self._learning: set[int] = {id(p) for p in self.params} if sparse else set()
        #: parameters whose gradients are sparse: reduced densely, handed back sparse
        self.sparse: set[int] = set()
        #: ``hold``: launch nothing during backward; at its end call ``hold()`` (it may change
        #: the complete local gradients: clipping by the local norm), then launch every bucket
        self.hold = hold
        self.buckets = (list(buckets) if buckets is not None
                        else [Bucket(i, ps) for i, ps in enumerate(plan_buckets(self.params, cap_bytes))])
        self._where: dict[int, tuple[Bucket, int]] = {}
        for b in self.buckets:
            for j, p in enumerate(b.params):
                self._where[id(p)] = (b, j)
        #: ``check_nan_inf``: the parameters (indices in bucket order, the same on every rank)
        #: whose gradient this backward was non-finite before its reduction; the ranks agree on
        #: them at the backward's end (`agree_finite`)
        self._non_finite: list[int] = []
        self.armed = False
        self._pending: list[int] = []
        self._seen: list[list[bool]] = []
        self._works: list[Work | None] = []
        self._next = 0
        self.collectives_issued = 0
        self.bytes_issued = 0
        #: the owner of the buckets zeroed them all since the last gradient (`mark_zeroed`)
        self._zeroed = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        self._attach()

    def _attach(self, keep: bool = True) -> None:
        """Every parameter's ``.grad`` its bucket view (but those whose first gradient may still
        be sparse), folding a replaced gradient in (``keep``) or dropping it (zeroing)."""
        if not keep:
            learning = self._learning
            for b in self.buckets:
                for p, view in zip(b.params, b.views):
                    if learning and id(p) in learning:
                        p.grad = None
                        continue
                    g = p.grad
                    # autograd accumulates into the view in place, so it is the same object:
                    # one identity test per parameter on the per-step path
                    if g is not view and (g is None or g.is_sparse or g.data_ptr() != view.data_ptr()):
                        p.grad = view
            return
        if not self._learning:
            for b in self.buckets:
                b.attach()
            return
        for b in self.buckets:
            for p, view in zip(b.params, b.views):
                if id(p) not in self._learning:
                    self._fold(p, view)

    # ------------------------------------------------------------------ lifecycle of a step

    def prepare(self, roots: torch.Tensor | Sequence[torch.Tensor] | None = None) -> None:
        """Arm the hooks for one communicating backward (call right before it, or after the
        forward: ``roots`` are the loss or the model's outputs, walked for unused parameters)."""
        with self._lock:
            self._prepare(roots)

    @property
    def stopped(self) -> bool:
        """A communicating backward began (its first gradient arrived) and never reached its
        end: it raised midway (an error in the model or in a gradient hook) and the caller went
        on. Its buckets' collectives may still be moving; `zero_grad` and `prepare` wait for
        them (`_stop`) before touching the buffers. (A reducer with a gate owns its passes.)"""
        return self.armed and self._callback_queued and self.gate is None

    def _prepare(self, roots: torch.Tensor | Sequence[torch.Tensor] | None) -> None:
        if self.stopped:
            self._stop()
        self._zeroed = False
        self._attach()
        self._begin()
        if self.find_unused and roots is not None:
            for p in unused_parameters(roots, self.params):
                self._mark(p)

    def _begin(self) -> None:
        self.armed = True
        self._non_finite = []
        self._callback_queued = False
        self._pending = [len(b.params) for b in self.buckets]
        self._seen = [[False] * len(b.params) for b in self.buckets]
        self._works = [None] * len(self.buckets)
        self._next = 0

    def _on_grad(self, p: torch.Tensor) -> None:
        with self._lock:
            self._zeroed = False
            if self._learning and id(p) in self._learning:
                self._learning.discard(id(p))
                if p.grad is not None and p.grad.is_sparse:
                    self.sparse.add(id(p))
            if self.gate is not None and not self._in_pass:
                self._begin_pass()
            self._grad_ready(p)

    def _begin_pass(self) -> None:
        assert self.gate is not None
        communicates = self.gate.begin_pass()  # may raise: then this backward stops here
        self._in_pass = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_pass)
        if communicates:
            self._prepare(None)
            self._callback_queued = True  # `_end_pass` finalizes

    def _end_pass(self) -> None:
        assert self.gate is not None
        with self._lock:
            self._in_pass = False
            if not self.armed:
                return
            self.gate.before_wait()  # while the buckets are in flight
            self.fold()  # parameters this backward did not reach: zeros
            self._finalize()
            self.gate.after_wait()

    @staticmethod
    def _fold(p: torch.Tensor, view: torch.Tensor) -> None:
        g = p.grad
        if g is view:  # accumulated in place (the per-step case)
            return
        if g is None:
            view.zero_()
        elif g.is_sparse:
            view.copy_(g.to_dense())
        elif g.data_ptr() != view.data_ptr() or g.shape != view.shape:
            view.copy_(g)
        else:
            return
        p.grad = view

    def fold(self) -> None:
        """Make every parameter's gradient its bucket view (zeros where it has none), so the
        buckets hold exactly the current gradients."""
        with self._lock:
            self._learning.clear()
            for b in self.buckets:
                for p, view in zip(b.params, b.views):
                    if p.grad is not view:
                        self._fold(p, view)

    def restore_sparse(self) -> None:
        """Hand the gradients of the parameters that got sparse ones back sparse (a sparse
        optimizer such as ``SparseAdam`` needs them so); `zero_grad` makes them views again."""
        with self._lock:
            if not self.sparse:
                return
            for p in self.params:
                if id(p) in self.sparse and p.grad is not None and not p.grad.is_sparse:
                    p.grad = p.grad.to_sparse()

    def _grad_ready(self, p: torch.Tensor) -> None:
        if not self.armed:
            return  # a local backward (no_sync, a gradient-merge micro-step, _origin_program)
        if not self._callback_queued:
            # As DDP: the end of this backward waits for every bucket, so a plain optimizer (or
            # anything reading .grad) after loss.backward() sees averaged gradients.
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finalize)
        bucket, j = self._where[id(p)]
        g = p.grad
        if g is not None and g is not bucket.views[j]:  # the user replaced .grad (set_to_none), or it is sparse
            self._fold(p, bucket.views[j])
        self._mark_at(bucket, j)

    def _mark(self, p: torch.Tensor) -> None:
        bucket, j = self._where[id(p)]
        self._mark_at(bucket, j)

    def _mark_at(self, bucket: Bucket, j: int) -> None:
        if self._seen[bucket.index][j]:
            return
        self._seen[bucket.index][j] = True
        self._pending[bucket.index] -= 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        if self.hold is not None:
            return
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._launch(self.buckets[self._next])

    def _launch(self, bucket: Bucket) -> None:
        if self.check_nan_inf:
            params = bucket.params
            if self.gate is not None:
                # Horovod's optimizer: a rank inside hvd.join() answers the buckets only, so no
                # agreement of its own can run at the end; this rank stops alone
                bad = non_finite(bucket.buffer, bucket.views,
                                 lambda i: self._names.get(id(params[i]), f"parameter {tuple(params[i].shape)}"))
                if bad:
                    self._raise_non_finite(bucket, bad)
            else:
                # the bucket is reduced all the same, so every rank's collectives stay paired;
                # the ranks agree at the end of the backward, before anything reads the result
                bad_at = non_finite(bucket.buffer, bucket.views, lambda i: i)
                if bad_at:
                    first = sum(len(b.params) for b in self.buckets[:bucket.index])
                    self._non_finite.extend(first + i for i in bad_at)
        started = time.perf_counter()
        self._works[bucket.index] = self.collective.start(bucket)
        self.wait_seconds += time.perf_counter() - started
        self.collectives_issued += 1
        self.bytes_issued += bucket.nbytes
        self._next += 1

    def _agree_finite(self) -> None:
        """End of a communicating backward, every bucket reduced: with ``check_nan_inf``, raise
        the same error on every rank when any rank's gradients were non-finite (one small
        all-reduce), so no rank goes on to an update, or to a collective, that the others skip."""
        if not self.check_nan_inf or self.gate is not None:
            return
        bad, self._non_finite = self._non_finite, []

        def name_of(i: int) -> str:
            p = [p for b in self.buckets for p in b.params][i]
            return self._names.get(id(p), f"parameter {tuple(p.shape)}")

        agree_finite(self.collective.world, bad, name_of, "before their reduction")

    def _raise_non_finite(self, bucket: Bucket, bad: list[str]) -> None:
        self._stop()
        world = self.collective.world
        raise FloatingPointError(
            f"rank {world.ranks[world.rank]}: the gradient of {', '.join(bad)} contains NaN or Inf "
            f"before its allreduce (bucket {bucket.index}); stopping here so it does not spread to "
            "every rank. Look at this rank's data and loss (strategy.check_nan_inf found it)"
        )

    def _stop(self) -> None:
        """A backward stopped before its end (a non-finite gradient, an error in the model):
        disarm and wait for the buckets it launched, so no collective of it is still moving when
        the caller goes on (a ``zero_grad`` then really clears the buffers, and the next step's
        collectives pair with the next step's). Every rank stopped at the same bucket launched
        the same ones before it."""
        self.armed = False
        for i, w in enumerate(self._works):
            if w is not None:
                started = time.perf_counter()
                w.wait()
                self.wait_seconds += time.perf_counter() - started
                self._works[i] = None

    def finalize(self) -> None:
        """Launch what is left (unused parameters), wait for every bucket, disarm."""
        with self._lock:
            self._finalize()

    def _finalize(self) -> None:
        if not self.armed:
            return
        if self.hold is not None and self._next == 0:
            self.hold()
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        started = time.perf_counter()
        for w in self._works:
            if w is not None:
                w.wait()
        self.wait_seconds += time.perf_counter() - started
        self.armed = False
        self._agree_finite()

    def zero_grad(self) -> None:
        """Zero the gradients in place (they are views: never set them to None); a no-op on
        buffers `mark_zeroed` vouches for (a memset of every gradient byte saved per step)."""
        with self._lock:
            if self.stopped:
                self._stop()
            zeroed, self._zeroed = self._zeroed, False
        for b in self.buckets:
            if not zeroed:
                b.zero_()
        self._attach(keep=False)

    def mark_zeroed(self) -> None:
        """The caller has just zeroed every bucket (sharding's gather does, after the update):
        the next `zero_grad` need not, unless a gradient or a `prepare` comes first."""
        with self._lock:
            self._zeroed = True

    def rebucket(self, cap_bytes: int | None, collective: BucketCollective) -> None:
        """Between steps: lay the gradients out in buckets of at most ``cap_bytes`` and combine
        them with ``collective`` from the next backward on (the online tuner's switch). The
        current gradients are copied into the new buckets, so a step's update is unchanged; the
        hooks stay (they find each parameter's bucket anew)."""
        with self._lock:
            if self.armed:
                raise RuntimeError("GradReducer.rebucket: a backward's buckets are in flight; switch between steps")
            if self._learning:
                raise RuntimeError("GradReducer.rebucket: sparse gradients are still being learnt; rebuild the reducer")
            self.collective = collective
            if [[id(p) for p in b.params] for b in self.buckets] == [
                    [id(p) for p in ps] for ps in plan_buckets(self.params, cap_bytes)]:
                return
            grads = {id(p): p.grad for p in self.params}
            self.buckets = [Bucket(i, ps) for i, ps in enumerate(plan_buckets(self.params, cap_bytes))]
            self._where = {id(p): (b, j) for b in self.buckets for j, p in enumerate(b.params)}
            for b in self.buckets:
                for p, view in zip(b.params, b.views):
                    g = grads[id(p)]
                    if g is not None:
                        view.copy_(g.to_dense() if g.is_sparse else g)
                    p.grad = view

    def grad_buffers(self) -> list[torch.Tensor]:
        """The tensors holding this rank's gradients after a communicating backward (what AMP
        unscales and gradient merge divides): the bucket buffers."""
        return [b.buffer for b in self.buckets]

    def remove(self) -> None:
        """Detach the hooks (the buffers stay as the grads)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def describe(self) -> list[dict[str, Any]]:
        return [{"bucket": b, **self.collective.describe(b)} for b in self.buckets]

    @property
    def collective_world(self) -> Communicator:
        return self.collective.world


def make_reducer(
    model: torch.nn.Module | Sequence[torch.nn.Parameter],
    collective: BucketCollective,
    *,
    cap_bytes: int | None,
    find_unused: bool = False,
    check_nan_inf: bool = False,
    buckets: Sequence[Bucket] | None = None,
    hold: Callable[[], None] | None = None,
    names: dict[int, str] | None = None,
    gate: PassGate | None = None,
    sparse: bool = False,
    lock: threading.RLock | None = None,
) -> GradReducer:
    """The `GradReducer` for ``model``'s parameters (a module, or the parameters of an
    optimizer with their ``names``), named for error messages.

    The one way it is built (by `fleetlike.strategies.data_parallel` for both styles, sharding,
    and Horovod's optimizer), so buckets and names are alike everywhere.
    ``cap_bytes`` is ``DistributedStrategy.bucket_cap_bytes()``; ``buckets`` replaces the
    default plan (sharding lays its buckets out per rank, `fleetlike.collectives.sharded`;
    Horovod's ``groups=``)."""
    if isinstance(model, torch.nn.Module):
        params: list[torch.nn.Parameter] = list(model.parameters())
        names = {id(p): n for n, p in model.named_parameters()} if names is None else names
    else:
        params = list(model)
    return GradReducer(
        params,
        collective,
        cap_bytes=cap_bytes,
        find_unused=find_unused,
        check_nan_inf=check_nan_inf,
        buckets=buckets,
        hold=hold,
        names=names,
        gate=gate,
        sparse=sparse,
        lock=lock,
    )

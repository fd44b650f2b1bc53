"""The one `Communicator` interface every caller uses, and its naming grid.

Every collective exists in two forms on one grid:

=====================  ==========================================================
``all_reduce(t, op)``  blocking; returns the result tensor
``all_reduce_async``   returns a `Work` handle; ``handle.wait()`` returns the result
=====================  ==========================================================

and each is *in place* or *out of place* by the ``out=`` keyword, following NCCL's definition:

- ``all_reduce`` / ``broadcast`` / ``reduce``: ``out=None`` writes into ``t``; ``out=o`` leaves
  ``t`` untouched and writes into ``o``.
- ``all_gather_flat(t, out=None)``: the result is a new ``world * numel`` tensor; passing
  ``t = out.chunk(world)[rank]`` (the rank's slice of ``out``) is the in-place form.
- ``reduce_scatter(t, out=None)``: ``t`` holds ``world`` equal chunks; the reduced chunk of this
  rank goes to a new tensor, or to ``out``; ``out = t.chunk(world)[rank]`` is the in-place form.
- ``all_gather(t)`` returns a list of ``world`` tensors (or fills ``out=list``).

Backends implement only the ``_*_start`` primitives declared in `fleetlike.comm.core` (and,
where blocking calls are cheaper, the ``_*_now`` forms the blocking grid calls use) on
*contiguous* tensors of dtypes they support, and `_split`; this class does the argument checks,
dtype conversion (a backend without, say, bfloat16 reductions gets float32 on the wire and the
result is cast back), AVG as SUM then divide, aliasing for the in-place forms and the
statistics, and hands each call to `CommunicatorCore._issue` for the agreement checks of `guard`
(by default, one small all-reduce that makes ranks passing different sizes raise
`CollectiveMismatchError` instead of aborting inside gloo), once for all backends.

Example:
    >>> comm = SingleCommunicator()
    >>> comm.all_reduce(torch.ones(3), op="sum")
    tensor([1., 1., 1.])
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable
from typing import Any, ContextManager

import torch

from fleetlike.comm import coded as _coded
from fleetlike.comm import guard as _guard
from fleetlike.comm.core import CommunicatorCore, _flat, divide_
from fleetlike.comm.dtypes import SUPPORTED_DTYPES
from fleetlike.comm.errors import CommError
from fleetlike.comm.handles import DONE as _DONE
from fleetlike.comm.handles import CompletedWork, Work
from fleetlike.comm.handles import finish as _finish
from fleetlike.comm.ops import GRID, ReduceOp
from fleetlike.comm.stats import CommStats

# ReduceOp, Work, CompletedWork, CommStats, SUPPORTED_DTYPES and CommError live in their own
# modules (ops, handles, stats, dtypes, errors) and are re-exported here, where callers found them.
__all__ = [
    "ReduceOp",
    "Work",
    "CompletedWork",
    "Communicator",
    "CommStats",
    "SUPPORTED_DTYPES",
    "CommError",
]


class Communicator(CommunicatorCore):
    """A group of ranks that run collectives together. See the module docstring for the grid.

    Attributes:
        backend: "gloo", "mpi", "nccl" or "single".
        rank / size: this process's position in, and the size of, the group.
        ranks: the world ranks of the members, in group-rank order.
        name: a label shown in programs and errors ("world", "intra[node 0]", "ring 1", ...).
    """

    # ----------------------------------------------------------------- the backend's split

    @abc.abstractmethod
    def _split(self, color: int | None, key: int) -> Communicator | None:
        """Collective over this group; members with equal color form a new communicator."""

    # ----------------------------------------------------------------- public grid

    def all_reduce_async(
        self,
        tensor: torch.Tensor,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        out: torch.Tensor | None = None,
        agreed: bool = False,
    ) -> Work:
        """Start an allreduce; the result lands in ``out`` (or ``tensor`` when ``out`` is None).

        ``agreed=True`` (on every grid call): the caller guarantees every rank passes the same
        size, dtype and op (gradient buckets built from one model), so the default size check,
        one small all-reduce before the data, is skipped. ``check_collectives`` still checks."""
        return self._all_reduce(tensor, op, out, False, agreed)

    # Each grid call has one private body, ``_<op>(..., blocking)``: blocking, it runs the
    # backend's blocking primitive and returns the result; otherwise it returns a `Work`.

    def _all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp | str, out: torch.Tensor | None, blocking: bool, agreed: bool
    ) -> Any:
        red = ReduceOp.parse(op, GRID)
        self._check("all_reduce", tensor)
        target = tensor if out is None else out
        if out is not None:
            self._check_same("all_reduce", tensor, out)
        wire = self._wire_dtype(tensor.dtype, red)
        avg_here = red is ReduceOp.AVG and not self.native_avg
        backend_op = ReduceOp.SUM if avg_here else red
        if wire != tensor.dtype:
            buf = tensor.to(wire).contiguous()
        elif out is None:
            buf = tensor.contiguous()  # the tensor itself when contiguous, else a copy
        elif out.is_contiguous():
            buf = out.copy_(tensor)
        else:
            buf = tensor.clone(memory_format=torch.contiguous_format)
        self._record("all_reduce", buf.nbytes, buf.dtype)
        solo = self._solo()
        if solo and buf is target:
            return target if blocking else CompletedWork(target)
        start = self._all_reduce_now if blocking else self._all_reduce_start
        inner = CompletedWork(buf) if solo else self._issue("all_reduce", tensor, start, (buf, backend_op), red, None, agreed)
        if not avg_here and buf is target:
            return _finish(inner, lambda: target, blocking)
        size = self.size

        def finish() -> torch.Tensor:
            if avg_here:
                divide_(buf, size)
            if buf is not target:
                target.copy_(buf)
            return target

        return _finish(inner, finish, blocking)

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        out: torch.Tensor | None = None,
        agreed: bool = False,
    ) -> torch.Tensor:
        """Reduce ``tensor`` over all ranks; every rank gets the result. See `all_reduce_async`."""
        return self._all_reduce(tensor, op, out, True, agreed)

    def broadcast_async(
        self, tensor: torch.Tensor, root: int = 0, *, out: torch.Tensor | None = None, agreed: bool = False
    ) -> Work:
        """Start copying ``root``'s tensor to every rank (into ``out`` when given)."""
        return self._broadcast(tensor, root, out, False, agreed)

    def _broadcast(
        self, tensor: torch.Tensor, root: int, out: torch.Tensor | None, blocking: bool, agreed: bool
    ) -> Any:
        self._check("broadcast", tensor)
        self._check_root("broadcast", root)
        target = tensor if out is None else out
        if out is not None:
            self._check_same("broadcast", tensor, out)
        if target.is_contiguous():
            buf = target
            if out is not None and self.rank == root:
                out.copy_(tensor)
        else:
            buf = target.contiguous() if out is None else tensor.contiguous().clone()
        self._record("broadcast", buf.nbytes, buf.dtype)
        start = self._broadcast_now if blocking else self._broadcast_start
        inner = CompletedWork(buf) if self._solo() else self._issue("broadcast", buf, start, (buf, root), None, root, agreed)
        if buf is target:
            return _finish(inner, lambda: target, blocking)
        return _finish(inner, lambda: target.copy_(buf), blocking)

    def broadcast(
        self, tensor: torch.Tensor, root: int = 0, *, out: torch.Tensor | None = None, agreed: bool = False
    ) -> torch.Tensor:
        return self._broadcast(tensor, root, out, True, agreed)

    def reduce_async(
        self,
        tensor: torch.Tensor,
        root: int = 0,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        out: torch.Tensor | None = None,
        agreed: bool = False,
    ) -> Work:
        """Start a reduction to ``root``. Non-root ranks' ``tensor`` and ``out`` are unchanged."""
        return self._reduce(tensor, root, op, out, False, agreed)

    def _reduce(
        self,
        tensor: torch.Tensor,
        root: int,
        op: ReduceOp | str,
        out: torch.Tensor | None,
        blocking: bool,
        agreed: bool,
    ) -> Any:
        red = ReduceOp.parse(op, GRID)
        self._check("reduce", tensor)
        self._check_root("reduce", root)
        if out is not None:
            self._check_same("reduce", tensor, out)
        target = tensor if out is None else out
        wire = self._wire_dtype(tensor.dtype, red)
        avg_here = red is ReduceOp.AVG and not self.native_avg
        # Work on a private buffer: backends may scribble on non-root inputs.
        buf = tensor.to(wire, memory_format=torch.contiguous_format, copy=True)
        self._record("reduce", buf.nbytes, buf.dtype)
        inner = (
            CompletedWork(buf)
            if self._solo()
            else self._issue(
                "reduce",
                tensor,
                self._reduce_now if blocking else self._reduce_start,
                (buf, root, ReduceOp.SUM if avg_here else red),
                red,
                root,
                agreed,
            )
        )
        is_root = self.rank == root
        size = self.size

        def finish() -> torch.Tensor:
            if is_root:
                if avg_here:
                    divide_(buf, size)
                target.copy_(buf)
            return target

        return _finish(inner, finish, blocking)

    def reduce(
        self,
        tensor: torch.Tensor,
        root: int = 0,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        out: torch.Tensor | None = None,
        agreed: bool = False,
    ) -> torch.Tensor:
        return self._reduce(tensor, root, op, out, True, agreed)

    def all_gather_flat_async(
        self, tensor: torch.Tensor, *, out: torch.Tensor | None = None, agreed: bool = False
    ) -> Work:
        """Start gathering every rank's ``tensor`` into one flat tensor of ``size * numel``.

        The in-place form passes ``tensor = out.chunk(size)[rank]``: no copy is made. Every
        rank passes the same number of elements; for ragged data use `all_gather_ragged`."""
        return self._all_gather_flat(tensor, out, False, agreed)

    def _all_gather_flat(self, tensor: torch.Tensor, out: torch.Tensor | None, blocking: bool, agreed: bool) -> Any:
        self._check("all_gather", tensor)
        n = tensor.numel()
        if out is None:
            out = torch.empty(self.size * n, dtype=tensor.dtype, device=tensor.device)
        else:
            self._check("all_gather", out, "out")
            if out.numel() != self.size * n or out.dtype != tensor.dtype:
                raise ValueError(
                    f"all_gather: out has {out.numel()} elements of {out.dtype}; it needs "
                    f"{self.size} x {n} = {self.size * n} elements of {tensor.dtype}"
                )
        flat_out = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
        chunk = tensor if tensor.is_contiguous() else tensor.contiguous()
        self._record("all_gather", flat_out.nbytes, flat_out.dtype)
        if self._solo():
            if chunk.data_ptr() != flat_out.data_ptr():
                flat_out.view(-1).copy_(chunk.view(-1))
            inner: Work = CompletedWork(None)
        else:
            start = self._all_gather_now if blocking else self._all_gather_start
            inner = self._issue("all_gather", chunk, start, (_flat(flat_out), _flat(chunk)), None, None, agreed)
        if flat_out is out:
            return _finish(inner, lambda: out, blocking)
        return _finish(inner, lambda: out.copy_(flat_out), blocking)

    def all_gather_flat(
        self, tensor: torch.Tensor, *, out: torch.Tensor | None = None, agreed: bool = False
    ) -> torch.Tensor:
        return self._all_gather_flat(tensor, out, True, agreed)

    def all_gather_async(
        self, tensor: torch.Tensor, *, out: list[torch.Tensor] | None = None, agreed: bool = False
    ) -> Work:
        """Start gathering every rank's ``tensor``; the result is a list of ``size`` tensors.

        Every rank passes the same shape; for ragged data use `all_gather_ragged`."""
        return self._all_gather(tensor, out, False, agreed)

    def _all_gather(
        self, tensor: torch.Tensor, out: list[torch.Tensor] | None, blocking: bool, agreed: bool
    ) -> Any:
        self._check("all_gather", tensor)
        if out is not None:
            if len(out) != self.size:
                raise ValueError(f"all_gather: out has {len(out)} tensors; it needs {self.size}")
            for i, o in enumerate(out):
                self._check_same("all_gather", tensor, o, what=f"out[{i}]")
        started = self._all_gather_flat(tensor, None, blocking, agreed)  # the flat result when blocking
        shape = tensor.shape
        size = self.size

        def finish() -> list[torch.Tensor]:
            flat = started if blocking else started.wait()
            parts = [p.view(shape) for p in flat.chunk(size)] if flat.numel() else [
                flat.new_empty(shape) for _ in range(size)
            ]
            if out is None:
                return parts
            for o, p in zip(out, parts):
                o.copy_(p)
            return out

        return _finish(_DONE, finish, blocking)

    def all_gather(
        self, tensor: torch.Tensor, *, out: list[torch.Tensor] | None = None, agreed: bool = False
    ) -> list[torch.Tensor]:
        return self._all_gather(tensor, out, True, agreed)

    def reduce_scatter_async(
        self,
        tensor: torch.Tensor,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        out: torch.Tensor | None = None,
        agreed: bool = False,
    ) -> Work:
        """Start reducing the flat ``tensor`` (``size`` equal chunks) and keep chunk ``rank``.

        The in-place form passes ``out = tensor.chunk(size)[rank]``."""
        return self._reduce_scatter(tensor, op, out, False, agreed)

    def _reduce_scatter(
        self, tensor: torch.Tensor, op: ReduceOp | str, out: torch.Tensor | None, blocking: bool, agreed: bool
    ) -> Any:
        red = ReduceOp.parse(op, GRID)
        self._check("reduce_scatter", tensor)
        if tensor.numel() % self.size:
            raise ValueError(
                f"reduce_scatter: tensor has {tensor.numel()} elements, not divisible by the "
                f"group size {self.size}; pad it to a multiple of {self.size}"
            )
        n = tensor.numel() // self.size
        if out is None:
            out = torch.empty(n, dtype=tensor.dtype, device=tensor.device)
        else:
            self._check("reduce_scatter", out, "out")
            if out.numel() != n or out.dtype != tensor.dtype:
                raise ValueError(
                    f"reduce_scatter: out has {out.numel()} elements of {out.dtype}; it needs "
                    f"{n} elements of {tensor.dtype}"
                )
        wire = self._wire_dtype(tensor.dtype, red)
        avg_here = red is ReduceOp.AVG and not self.native_avg
        # The input is consumed by the backend (and aliases ``out`` in place): hand it a copy
        # when the dtype changes, otherwise the tensor itself.
        if wire == tensor.dtype and tensor.is_contiguous():
            buf = _flat(tensor)
        else:
            buf = tensor.reshape(-1).to(wire)
        res = out if wire == out.dtype and out.is_contiguous() else torch.empty(n, dtype=wire, device=out.device)
        self._record("reduce_scatter", buf.nbytes, buf.dtype)
        if self._solo():
            if res.data_ptr() != buf.data_ptr():
                res.view(-1).copy_(buf)
            inner: Work = CompletedWork(None)
        else:
            start = self._reduce_scatter_now if blocking else self._reduce_scatter_start
            inner = self._issue(
                "reduce_scatter", tensor, start, (_flat(res), buf, ReduceOp.SUM if avg_here else red), red, None, agreed
            )
        if not avg_here and res is out:
            return _finish(inner, lambda: out, blocking)
        size = self.size

        def finish() -> torch.Tensor:
            if avg_here:
                divide_(res, size)
            if res is not out:
                out.copy_(res.view(out.shape))
            return out

        return _finish(inner, finish, blocking)

    def reduce_scatter(
        self,
        tensor: torch.Tensor,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        out: torch.Tensor | None = None,
        agreed: bool = False,
    ) -> torch.Tensor:
        return self._reduce_scatter(tensor, op, out, True, agreed)

    def all_reduce_coded_async(
        self,
        tensor: torch.Tensor,
        op: ReduceOp | str,
        code: int,
        accept: Callable[[list[int]], bool] = _coded.accept_all,
    ) -> Work:
        """Start reducing ``tensor`` in place together with one code per rank (`coded`): every
        rank learns every code before any rank writes, and the result is written only when
        ``accept(codes)`` (the same on every rank); otherwise ``tensor`` is left as it was.
        ``wait()`` returns the codes in rank order.

        Every rank passes the same element count, dtype and op (``tensor`` contiguous, any
        supported dtype: the reduction runs in torch, in the tensor's own dtype). Needs a backend
        with point-to-point messages (`has_p2p`); one such allreduce at a time per communicator."""
        red = ReduceOp.parse(op, GRID)
        self._check("all_reduce_coded", tensor)
        if not tensor.is_contiguous():
            raise ValueError("all_reduce_coded: the tensor must be contiguous (it is reduced in place, no copy); "
                             "pass tensor.contiguous() and read the result from it")
        if isinstance(code, bool) or not isinstance(code, int):
            raise TypeError(f"all_reduce_coded: code must be an int, got {type(code).__name__}")
        if self.size > 1 and not self.has_p2p:
            raise CommError(f"all_reduce_coded on communicator {self.name!r}: the {self.backend!r} backend has no "
                            "point-to-point messages; use all_reduce (agree first) on this backend")
        with self._coded_lock:
            if self._coded_busy:
                raise CommError(f"all_reduce_coded on communicator {self.name!r}: another coded allreduce is still "
                                "in flight on it; wait for it first (one at a time per communicator)")
            self._coded_busy = True
        self._record("all_reduce", tensor.nbytes, tensor.dtype)
        seq = self._seq = next(self._seqs)
        size = self.size

        def finish(buf: torch.Tensor) -> None:
            if red is ReduceOp.AVG:
                divide_(buf, size)

        def release() -> None:
            with self._coded_lock:
                self._coded_busy = False

        def fail(exc: BaseException) -> BaseException:
            return _guard.failure(self, "all_reduce", seq, exc)

        try:
            return _coded.CodedAllReduce(self, _flat(tensor), red, code, accept, fail, finish, release,
                                         self._coded_scratch)
        except BaseException:
            release()
            raise

    def _coded_scratch(self, dtype: torch.dtype, device: torch.device, numel: int) -> torch.Tensor:
        """The coded allreduce's receive space: kept per dtype and device, grown when too small
        (fresh pages cost more than the copy they receive: 64 MiB on two ranks took 1.6x as long)."""
        key = (dtype, device)
        space = self._coded_space.get(key)
        if space is None or space.numel() < numel:
            space = self._coded_space[key] = torch.empty(numel, dtype=dtype, device=device)
        return space

    def barrier_async(self) -> Work:
        if self._closed:
            raise CommError(f"barrier on communicator {self.name!r}, which was closed")
        return CompletedWork(None) if self._solo() else self._issue("barrier", None, self._barrier_start, (), None, None, True)

    def barrier(self) -> None:
        """All members meet: returns once every rank of the group has called it."""
        if self._closed:
            raise CommError(f"barrier on communicator {self.name!r}, which was closed")
        if not self._solo():
            self._issue("barrier", None, self._barrier_now, (), None, None, True).wait()

    def split(self, color: int | None, key: int | None = None, *, name: str | None = None) -> Communicator | None:
        """Collective: ranks passing the same ``color`` form a new communicator.

        ``color=None`` takes no part (returns None), as MPI_UNDEFINED. Ranks are ordered by
        ``key`` (default: the current rank), then by current rank."""
        if color is not None and (isinstance(color, bool) or not isinstance(color, int) or color < 0):
            raise ValueError(f"split: color={color!r} must be a non-negative int or None")
        sub = self._split(color, self.rank if key is None else key)
        if sub is not None:
            sub.timeout = self.timeout
            sub.check_collectives = self.check_collectives
            sub.check_sizes = self.check_sizes
            sub.interrupt = self.interrupt
            if name is not None:
                sub.name = name
        return sub

    def group(self) -> ContextManager[None]:
        """Launch the collectives started inside the ``with`` block together, where the backend
        can (NCCL's groupStart / groupEnd: several buckets in one launch); a no-op elsewhere, so
        callers can always write it. Wait on the handles after the block, not inside it.

        Example:
            >>> with comm.group():
            ...     works = [comm.all_reduce_async(b) for b in buckets]
            >>> results = [w.wait() for w in works]
        """
        return contextlib.nullcontext()

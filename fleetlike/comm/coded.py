"""A coded allreduce: one small integer per rank travels with the data, and the result is written
only when the codes, which every rank learns before any rank writes, say so.

Why: a caller that must agree before it reduces (Horovod's face: every rank's call must be the
same one, or the call raises and leaves the tensor as it was) pays one more collective per call
for the agreement: a round trip, 0.2-1.8 ms on loopback gloo on two shared cores, as long as the
data of a 4 MiB allreduce. Carried in the data's own buffer (slots after the data,
`fleetlike.horovod.speculate`) the agreement is free on the wire but costs a copy of the data in
and out, which loses from a few MiB on. Here the agreement costs neither.

How: the ring allreduce of gloo and NCCL (reduce-scatter, then allgather), written over
point-to-point messages. Every reduce-scatter message is a chunk of partial sums *and* the codes
of the ranks it went through; a rank adds its own chunk into the message it received (never into
its buffer) and passes both on. After the last reduce-scatter step every rank holds one fully
reduced chunk and every rank's code, while every buffer is still untouched. ``accept(codes)``,
the same on every rank, then decides: accepted, each rank writes its chunk and the allgather
fills the rest; refused, every rank stops there, its buffer as it was. The buffer is the
caller's: no copy of the data, and the codes ride beside the chunks (two small messages a step).

Every rank must pass the same element count, dtype and op (the codes are how a caller finds out
that the *calls* differ; the messages themselves must match). The handle makes progress when
polled (`CodedAllReduce.is_completed`, non-blocking) as well as when waited, so a rank can keep
answering other collectives while one of these is in flight (``hvd.join``). One at a time per
communicator. Each message is waited whole: a gloo point-to-point handle waited with a timeout
is failed by it, so the sliced waits that let an elastic world's ``interrupt`` fail a blocked
collective within 0.25 s (`guard.wait_work`) do not apply; a ring on such a communicator ends
at the timeout (the Horovod face does not use rings there).

Example (two ranks; rank 1 refuses):
    >>> work = comm.all_reduce_coded_async(t, "sum", code=2 if rank == 0 else 0,
    ...                                    accept=lambda codes: 0 not in codes)
    >>> work.wait()      # [2, 0] on both ranks; t is unchanged on both
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from fleetlike.comm.errors import CommError
from fleetlike.comm.handles import Work
from fleetlike.comm.ops import ReduceOp

__all__ = ["CODED_OPS", "CodedAllReduce", "accept_all"]

#: the reductions a coded allreduce runs (AVG: the sum, divided at the end)
CODED_OPS = frozenset({ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PROD})
#: chunks travel in pieces of at most this many bytes, so that reducing and passing on one piece
#: overlaps the transfer of the next (as gloo's own ring does)
SEGMENT_BYTES = 4 << 20


def _tag(kind: int, step: int, piece: int = 0) -> int:
    """A message's tag: what it is (1 codes, 2 reduce-scatter data, 3 allgather data), the ring
    step, the piece; so no message can be matched to another's receive."""
    return (kind << 28) | (step << 16) | piece


def accept_all(codes: Sequence[int]) -> bool:
    """Accept whatever the codes (a caller that agreed already)."""
    return True


class P2P(Protocol):
    """What the ring needs of a communicator (`fleetlike.comm.base.Communicator` with p2p)."""

    rank: int
    size: int

    def _send_start(self, buf: torch.Tensor, dst: int, tag: int) -> Work: ...

    def _recv_start(self, buf: torch.Tensor, src: int, tag: int) -> Work: ...


def _combine(acc: torch.Tensor, other: torch.Tensor, op: ReduceOp) -> None:
    """``acc = acc op other``, in place."""
    if op is ReduceOp.SUM or op is ReduceOp.AVG:
        acc.add_(other)
    elif op is ReduceOp.PROD:
        acc.mul_(other)
    elif op is ReduceOp.MIN:
        torch.minimum(acc, other, out=acc)
    else:
        torch.maximum(acc, other, out=acc)


class CodedAllReduce(Work):
    """The handle of one coded allreduce. ``wait()`` runs the ring (or waits for the thread
    running it) and returns every rank's code (a list, in rank order); ``is_completed()`` never
    blocks.

    A failure (a peer gone, the timeout) is turned into the communicator's diagnosed
    `CollectiveError` by ``fail(exc)``, given by the communicator that started it.
    """

    def __init__(self, comm: P2P, buf: torch.Tensor, op: ReduceOp, code: int,
                 accept: Callable[[list[int]], bool], fail: Callable[[BaseException], BaseException],
                 finish: Callable[[torch.Tensor], None], release: Callable[[], None],
                 scratch: Callable[[torch.dtype, torch.device, int], torch.Tensor]) -> None:
        self._comm, self._fail, self._release, self._scratch = comm, fail, release, scratch
        self._args = (buf, op, code, accept, finish)
        self._lock = threading.Lock()  # held by whoever runs the ring
        self._codes: list[int] | None = None
        self._error: BaseException | None = None
        #: set once the codes (or the error) are there
        self._finished = threading.Event()
        #: the thread that runs the ring once somebody polls (gloo's point-to-point handles
        #: report completion only when waited, so progress without blocking needs a waiter)
        self._driver: threading.Thread | None = None
        self._driver_lock = threading.Lock()

    def wait(self) -> list[int]:
        with self._lock:
            if not self._finished.is_set():
                self._execute()
        if self._error is not None:
            raise self._error
        assert self._codes is not None
        return self._codes

    def is_completed(self) -> bool:
        """Never blocks. The first poll of an unfinished ring hands it to a thread of its own (a
        gloo message cannot be polled, only waited); ``wait`` then waits for that thread. A
        caller that only waits runs the whole ring on its own thread."""
        if self._finished.is_set():
            return True
        with self._driver_lock:
            if self._driver is None:
                self._driver = threading.Thread(target=self._drive, name="fleetlike-coded-allreduce", daemon=True)
                self._driver.start()
        return self._finished.is_set()

    def _drive(self) -> None:
        with self._lock:
            if not self._finished.is_set():
                self._execute()  # a failure is kept in self._error, for wait() to raise

    def _execute(self) -> None:
        try:
            self._codes = self._ring(*self._args)
        except CommError as exc:
            self._error = exc
        except Exception as exc:  # noqa: BLE001 - the backends raise RuntimeError and friends
            self._error = self._fail(exc)
        finally:
            self._args = ()  # type: ignore[assignment]  # drop the buffer
            self._release()
            self._finished.set()

    # ------------------------------------------------------------------ the ring

    def _ring(self, buf: torch.Tensor, op: ReduceOp, code: int, accept: Callable[[list[int]], bool],
              finish: Callable[[torch.Tensor], None]) -> list[int]:
        """Run the ring on ``buf``; return the codes.

        Sends are posted before the receives they pair with when the order is free: on gloo a
        send whose receive is not posted yet returns at once (the data follow when it is), while
        a receive posted first makes the send that meets it write its data on the caller's
        thread (1 MiB took 2.9 ms a call that way, 1.0 ms the other, loopback, two ranks). A
        chunk is empty when there are fewer elements than ranks: no message carries it, and the
        rank it would go to knows (the same bounds) and does not wait for one."""
        comm = self._comm
        n, r = comm.size, comm.rank
        if n == 1:
            if accept([code]):
                finish(buf)
            return [code]
        right, left = (r + 1) % n, (r - 1) % n
        count = buf.numel()
        bounds = [c * count // n for c in range(n + 1)]
        seg = max(1, SEGMENT_BYTES // buf.element_size())

        def pieces(c: int) -> list[tuple[int, int]]:
            return [(a, min(a + seg, bounds[c + 1])) for a in range(bounds[c], bounds[c + 1], seg)]

        def wait(works: list[Any]) -> None:
            for w in works:
                w.wait()  # once, and whole: a gloo message's wait consumes it (see the module doc)

        widest = max(bounds[c + 1] - bounds[c] for c in range(n))
        # two receive buffers: one is passed on while the next chunk lands in the other
        space = self._scratch(buf.dtype, buf.device, widest * min(2, n - 1))
        held = [space[i * widest : (i + 1) * widest] for i in range(min(2, n - 1))]
        codes = [torch.full((n,), -1, dtype=torch.int64) for _ in range(3)]

        def post_recvs(c: int, into: torch.Tensor, base: int, kind: int, step: int) -> list[Any]:
            return [comm._recv_start(into[a - base : b - base], left, _tag(kind, step, k))
                    for k, (a, b) in enumerate(pieces(c))]

        # reduce-scatter: a rank adds its chunk into what it received and passes it on; the
        # buffer is only read. Step 0 sends this rank's own chunk, straight from the buffer.
        codes[2][r] = code
        sent_codes = comm._send_start(codes[2], right, _tag(1, 0))
        sent = [comm._send_start(buf[a:b], right, _tag(2, 0, k)) for k, (a, b) in enumerate(pieces(r))]
        c_in = (r - 1) % n
        got_codes = comm._recv_start(codes[0], left, _tag(1, 0))
        got = post_recvs(c_in, held[0], bounds[c_in], 2, 0)
        for s in range(n - 1):
            cur, nxt = s % 2, (s + 1) % 2
            c_in, base = (r - s - 1) % n, bounds[(r - s - 1) % n]
            wait([got_codes, sent_codes])
            codes[cur][r] = code
            if s == n - 2:
                break
            # step s + 1 lands in the other buffer, which step s's messages were sent from
            wait(sent)
            sent_codes = comm._send_start(codes[cur], right, _tag(1, s + 1))
            got_codes = comm._recv_start(codes[nxt], left, _tag(1, s + 1))
            c_next = (r - s - 2) % n
            arriving = post_recvs(c_next, held[nxt], bounds[c_next], 2, s + 1)
            sent = []
            for k, (a, b) in enumerate(pieces(c_in)):  # each piece passed on as soon as it is added
                got[k].wait()
                part = held[cur][a - base : b - base]
                _combine(part, buf[a:b], op)
                sent.append(comm._send_start(part, right, _tag(2, s + 1, k)))
            got = arriving
        agreed = [int(v) for v in codes[(n - 2) % 2].tolist()]
        if not accept(agreed):
            wait(got + sent)  # every message of the ring is still received: none is left behind
            return agreed
        # this rank finished chunk r + 1; it is written now and goes round the ring (allgather)
        wait(sent)  # chunk r may have been sent from the buffer (step 0): free before it is written
        mine, last = (r + 1) % n, held[(n - 2) % 2]
        base = bounds[mine]
        arriving = post_recvs(r, buf, 0, 3, 0)
        sent = []
        for k, (a, b) in enumerate(pieces(mine)):
            got[k].wait()
            _combine(buf[a:b], last[a - base : b - base], op)
            sent.append(comm._send_start(buf[a:b], right, _tag(3, 0, k)))
        for s in range(1, n - 1):  # forward each piece of the chunk that arrived, as it arrives
            c_prev = (r - s + 1) % n
            got, arriving = arriving, post_recvs((r - s) % n, buf, 0, 3, s)
            for k, (a, b) in enumerate(pieces(c_prev)):
                got[k].wait()
                sent.append(comm._send_start(buf[a:b], right, _tag(3, s, k)))
        wait(arriving + sent)
        finish(buf)
        return agreed

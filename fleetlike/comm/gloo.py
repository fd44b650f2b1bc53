"""The `gloo` backend: torch's ProcessGroupGloo on CPU tensors, without torch's global state.

Each communicator owns its own ``ProcessGroupGloo`` built on a prefixed store, so fleetlike
never calls ``torch.distributed.init_process_group``: a user's own torch.distributed code (a DDP
comparison, say) keeps working beside it. Sockets bind to the rank's own IP, which is what makes
two "nodes" on 127.0.0.1 and 127.0.0.2 real, and keeps the job off other interfaces.

Every communicator is its own process group with its own worker threads, so buckets spread over
several communicators (``nccl_comm_num``) really run concurrently on CPU.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import ipaddress
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllreduceOptions,
    BarrierOptions,
    BroadcastOptions,
    ProcessGroupGloo,
    ReduceOptions,
    ReduceScatterOptions,
)

from fleetlike.comm.base import Communicator
from fleetlike.comm.colors import split_order
from fleetlike.comm.handles import Work
from fleetlike.comm.ops import ReduceOp

__all__ = ["GlooCommunicator", "settle_at_exit"]

#: how long the interpreter's exit lets go of the GIL for gloo's worker threads (`settle_at_exit`)
SETTLE_S = 0.02
_SETTLE = threading.Lock()
_SETTLING: list[bool] = []


def settle_at_exit() -> None:
    """Let gloo's worker threads finish before the interpreter finalises (registered once per
    process, by whatever makes a ProcessGroupGloo).

    torch 2.13's ProcessGroupGloo frees each finished work on its worker thread, and the work's
    saved thread-local state can hold a Python object (backward stashes its context there), whose
    release needs the GIL. A worker that asks for the GIL once the interpreter is finalising
    ends its thread by a forced unwind through a destructor that may not throw, and the process
    aborts ("terminate called without an active exception"): it happened in 1 of 40 two-rank
    DDP runs, under torchrun as under any launcher. An exit handler runs before finalisation;
    sleeping there hands the GIL to a waiting worker, which then finishes."""
    with _SETTLE:
        if not _SETTLING:
            _SETTLING.append(True)
            atexit.register(time.sleep, SETTLE_S)

_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.PROD: dist.ReduceOp.PRODUCT,
}


def _device(host: str) -> Any:
    """Bind to the rank's own IP; a placeholder host name (torchrun/MPI roles without
    FLEETLIKE_NODE_IPS) falls back to the interface of this machine's host name."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return ProcessGroupGloo.create_default_device()
    return ProcessGroupGloo.create_device(hostname=host)


#: Options objects, built once per (kind, reduction, root): the process group copies what it
#: needs from them, and a fresh one per call costs several pybind calls on the hot path.
_OPTIONS: dict[tuple[str, ReduceOp | None, int | None], Any] = {}
#: Aborted groups left alive on purpose (`GlooCommunicator._close`); appended only.
_ABANDONED: list[Any] = []  # guarded by _ABANDONED_LOCK
_ABANDONED_LOCK = threading.Lock()


def _options(kind: str, op: ReduceOp | None = None, root: int | None = None) -> Any:
    key = (kind, op, root)
    opts = _OPTIONS.get(key)
    if opts is None:
        opts = {
            "allreduce": AllreduceOptions,
            "broadcast": BroadcastOptions,
            "reduce": ReduceOptions,
            "reduce_scatter": ReduceScatterOptions,
            "barrier": BarrierOptions,
        }[kind]()
        if op is not None:
            opts.reduceOp = _OPS[op]
        if root is not None:
            opts.rootRank = root
            opts.rootTensor = 0
        opts = _OPTIONS.setdefault(key, opts)  # atomic: threads racing here share one object
    return opts


class GlooCommunicator(Communicator):
    """A gloo process group over ``store``.

    Args:
        store: a store private to this group (a prefix of the job's store).
        rank, size: position in and size of the group.
        ranks: world ranks of the members (for messages and sub-groups).
        name: label for programs and errors.
        host: the IP this rank's sockets bind to.
        timeout: seconds after which a collective that cannot complete raises.
    """

    backend = "gloo"
    has_p2p = True

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        ranks: Sequence[int],
        name: str,
        host: str,
        timeout: float,
    ) -> None:
        super().__init__(rank, size, ranks, name)
        self._store = store
        self._host = host
        self._timeout = timeout
        self._splits = 0
        opts = ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=timeout)
        opts._devices = [_device(host)]
        self._pg = ProcessGroupGloo(store, rank, size, opts)
        # gloo's full mesh is complete on a rank once its own connects succeed, which can be
        # before a peer has finished the handshake on the same connection; a rank that then
        # closes at once (it had nothing to do in this group) cuts that peer's handshake
        # ("Connection closed by peer" in the peer's constructor). One barrier: nobody leaves
        # creation before every member's mesh is up.
        self._pg.barrier(_options("barrier")).wait()
        settle_at_exit()
        self._aborted = False
        self.timeout = timeout
        self._diag_store = store

    @property
    def process_group(self) -> ProcessGroupGloo:
        """The underlying torch process group (for raw comparisons in benchmarks)."""
        return self._pg

    def _all_reduce_start(self, buf: torch.Tensor, op: ReduceOp) -> Work:
        return self._pg.allreduce([buf], _options("allreduce", op))

    def _broadcast_start(self, buf: torch.Tensor, root: int) -> Work:
        return self._pg.broadcast([buf], _options("broadcast", None, root))

    def _reduce_start(self, buf: torch.Tensor, root: int, op: ReduceOp) -> Work:
        return self._pg.reduce([buf], _options("reduce", op, root))

    def _all_gather_start(self, out: torch.Tensor, chunk: torch.Tensor) -> Work:
        return self._pg._allgather_base(out, chunk)

    def _reduce_scatter_start(self, out: torch.Tensor, buf: torch.Tensor, op: ReduceOp) -> Work:
        return self._pg._reduce_scatter_base(out, buf, _options("reduce_scatter", op))

    def _barrier_start(self) -> Work:
        return self._pg.barrier(_options("barrier"))

    def _send_start(self, buf: torch.Tensor, dst: int, tag: int) -> Work:
        return self._pg.send([buf], dst, tag)

    def _recv_start(self, buf: torch.Tensor, src: int, tag: int) -> Work:
        return self._pg.recv([buf], src, tag)

    def _split(self, color: int | None, key: int) -> Communicator | None:
        seq = self._splits
        self._splits += 1
        order = split_order(self._store, seq=seq, rank=self.rank, size=self.size, color=color, key=key,
                            timeout=self._timeout, name=self.name)
        if order is None:
            return None
        sub_store = dist.PrefixStore(f"split{seq}/c{color}/", self._store)
        return GlooCommunicator(
            sub_store,
            order.index(self.rank),
            len(order),
            [self.ranks[r] for r in order],
            f"{self.name}/split{seq}:{color}",
            self._host,
            self._timeout,
        )

    def _abort(self) -> None:
        super()._abort()
        self._aborted = True
        try:
            self._pg.abort()
        except Exception:  # noqa: BLE001 - best effort: the group is already broken
            pass

    def _close(self) -> None:
        if self._aborted and self._pg is not None:
            # A failed collective may still sit in gloo's worker thread, waiting on a peer whose
            # link is cut (nothing closes, so gloo only gives up at the op's timeout: 1800 s by
            # default). Shutting down would join that thread and hold the caller (an elastic
            # re-formation) as long; the broken group is left alive instead, never destroyed
            # (so neither now nor at exit does anything join it): a few idle threads per failure.
            with _ABANDONED_LOCK:
                _ABANDONED.append(self._pg)
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(self._pg))
            self._pg = None  # type: ignore[assignment]
            return
        # Shut the group down and drop it while the interpreter is alive: torch's destructor
        # joins gloo's worker threads with the GIL released. Left to interpreter teardown, a
        # worker thread releasing its last tensor races finalization and aborts the process
        # ("terminate called without an active exception"), turning a clean exit into SIGABRT.
        pg, self._pg = self._pg, None  # type: ignore[assignment]
        if pg is None:
            return
        try:
            pg.shutdown()
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass
        del pg

"""Point-to-point between two processes of one host: a byte ring in shared memory per direction.

Why: a pipeline's stages hand each micro-batch's activation forward and its gradient back,
and at two stages under 1F1B every handoff lands on the step's time. gloo's send over loopback
TCP wakes gloo's worker thread on each side and crosses the kernel twice; here the sender
copies the bytes into a ring both processes map and the receiver copies them out, a futex
waking it when it sleeps (``python -m bench.pipeline_handoff`` measures both side by side).

A `Ring` is one direction: the sender writes, the receiver reads, each message a 64-byte
header (tag, byte count) and its bytes, padded to 64. Counters grow monotonically: ``head``
(bytes written, the sender's) and ``tail`` (bytes read, the receiver's); each side bumps a
32-bit futex word after moving its counter and wakes the other. A message that fits in the
free space is copied at once (the send is done when ``send`` returns, as an eager MPI send);
a longer one streams as the receiver frees space. Either side may ``close`` the ring (a rank
aborting its links): a waiter on the other side then raises instead of waiting out the
timeout, and a waiter whose peer process has ended raises too.

The ring relies on x86-64's store order (a counter stored after the bytes is seen after them)
and on Linux's futex: `shm_unsupported` says why another machine takes gloo instead.

Example:
    >>> ring = Ring.create("/dev/shm/fleetlike-abc", 1 << 22)     # the sender
    >>> ring.send(t.data_ptr(), t.nbytes, tag=0, deadline=time.monotonic() + 60)
    >>> peer = Ring.open("/dev/shm/fleetlike-abc")                # the receiver (another process)
    >>> peer.recv(out.data_ptr(), out.nbytes, tag=0, deadline=time.monotonic() + 60)
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import struct
import sys
import time
from typing import Any

__all__ = ["Ring", "RingClosedError", "SHM_DIR", "shm_unsupported"]

#: where the rings' files live (a tmpfs on Linux)
SHM_DIR = "/dev/shm"
#: how long a waiter polls before it sleeps on the futex (seconds): a handoff that arrives
#: within it costs no wake-up, and a poll this short takes little from another process's core
SPIN_S = 50e-6
#: how long it then goes on polling, yielding its core between polls (``sched_yield``: any other
#: thread runnable there runs first), before it sleeps: a pipeline stage waits a fraction of a
#: micro-batch for its neighbour, and a wake-up from the futex took 0.1-0.3 ms on the benchmark's
#: machine, beside 18 us for a handoff whose receiver was polling
YIELD_S = 2e-3
#: how long one futex sleep lasts before the waiter checks the peer is alive and the deadline
SLICE_S = 0.05

_ALIGN = 64
_HEADER = 4096  # the control block before the data
_MAGIC = 0x464C4B5348524E47
# 8-byte words of the control block (index = offset // 8), each on its own cache line
_W_MAGIC, _W_CAP, _W_HEAD, _W_TAIL, _W_CLOSED, _W_PIDS = 0, 1, 8, 24, 40, 48
# 4-byte futex words (index = offset // 4)
_F_HEAD, _F_TAIL = 128, 160  # offsets 512 and 640, after the 8-byte words
_MSG = struct.Struct("<qQ")  # tag, byte count
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_SYS_FUTEX = 202  # x86-64
_memmove = ctypes.memmove  # releases the GIL, as every ctypes foreign call
_sched_yield = getattr(os, "sched_yield", lambda: None)


def shm_unsupported() -> str | None:
    """Why this machine cannot use the rings (None: it can)."""
    if sys.platform != "linux":
        return f"the shared-memory rings need Linux (futex), not {sys.platform}"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return (f"the shared-memory rings rely on x86-64's store order, and this is {platform.machine()}")
    if not os.path.isdir(SHM_DIR) or not os.access(SHM_DIR, os.W_OK):
        return f"{SHM_DIR} is missing or not writable"
    return None


class RingClosedError(RuntimeError):
    """The ring was closed by either side (a rank aborted its links) or the peer process ended."""


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_LIBC: Any = None


def _syscall() -> Any:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)  # CDLL calls release the GIL while they sleep
        _LIBC.syscall.restype = ctypes.c_long
    return _LIBC.syscall


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class Ring:
    """One direction of point-to-point traffic between two processes; see the module docstring."""

    def __init__(self, path: str, fd: int, created: bool, capacity: int = 0) -> None:
        self.path = path
        try:
            if created:
                try:  # the pages now: a tmpfs out of room would kill the process (SIGBUS) at first touch
                    os.posix_fallocate(fd, 0, _HEADER + capacity)
                except OSError as exc:
                    os.unlink(path)
                    raise OSError(exc.errno, (
                        f"{SHM_DIR} has no room for a {_HEADER + capacity}-byte ring ({exc.strerror}). Fix: give "
                        f"the job a larger {SHM_DIR} (docker --shm-size), or pipeline_configs.p2p='gloo'")) from exc
            size = os.fstat(fd).st_size
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._w = memoryview(self._mm)[:_HEADER].cast("Q")
        self._f = memoryview(self._mm)[:_HEADER].cast("I")
        if created:
            self._w[_W_CAP] = capacity
            self._w[_W_PIDS] = os.getpid()
            self._w[_W_MAGIC] = _MAGIC
        elif self._w[_W_MAGIC] != _MAGIC or size != _HEADER + self._w[_W_CAP]:
            self._release()
            raise RuntimeError(f"{path} is not a fleetlike ring (magic {self._w[_W_MAGIC]:#x}, {size} bytes)")
        else:
            self._w[_W_PIDS + 1] = os.getpid()
        self.capacity = int(self._w[_W_CAP])
        self._base = ctypes.c_char.from_buffer(self._mm)
        self._addr = ctypes.addressof(self._base)
        self._data = self._addr + _HEADER  # the bytes are copied by address: a torch copy's
        # dispatch, and slicing a view per piece, cost more than the 64 KiB copy itself
        self._words = {w: ctypes.c_void_p(self._addr + 4 * w) for w in (_F_HEAD, _F_TAIL)}
        self._syscall = _syscall()
        self._sender = created
        self._pending = 0  # bytes of a streamed message still to write or read
        self._check_pid = True

    @classmethod
    def create(cls, path: str, capacity: int) -> Ring:
        """The sender's end: a new file of ``capacity`` data bytes (a multiple of 64), mode 0600."""
        if capacity <= 0 or capacity % _ALIGN:
            raise ValueError(f"Ring capacity must be a positive multiple of {_ALIGN} bytes, got {capacity}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        return cls(path, fd, True, capacity)

    @classmethod
    def open(cls, path: str) -> Ring:
        """The receiver's end of a ring another process created."""
        return cls(path, os.open(path, os.O_RDWR), False)

    # ---------------------------------------------------------------- waiting

    def _wake(self, word: int) -> None:
        self._f[word] = (self._f[word] + 1) & 0xFFFFFFFF
        self._syscall(_SYS_FUTEX, self._words[word], _FUTEX_WAKE, 1, None, None, 0)

    def _closed(self) -> str | None:
        if self._w[_W_CLOSED]:
            return "the ring was closed (a rank of the pipeline aborted its links)"
        if self._check_pid:
            peer = int(self._w[_W_PIDS + (1 if self._sender else 0)])
            if peer:
                try:
                    os.kill(peer, 0)
                except ProcessLookupError:
                    return f"the peer process (pid {peer}) has ended"
                except PermissionError:  # another user's pid namespace: cannot tell
                    self._check_pid = False
        return None

    def _wait(self, ready: Any, word: int, deadline: float, what: str) -> None:
        """Return once ``ready()``; poll ``SPIN_S``, then ``YIELD_S`` yielding the core between
        polls, then sleep on futex ``word``."""
        if ready():
            return
        now = time.perf_counter()
        end_spin, end_yield = now + SPIN_S, now + SPIN_S + YIELD_S
        while time.perf_counter() < end_spin:
            if ready():
                return
        while time.perf_counter() < end_yield:
            _sched_yield()
            if ready():
                return
        syscall, addr = self._syscall, self._words[word]
        slice_ns = int(SLICE_S * 1e9)
        ts = _Timespec(slice_ns // 1_000_000_000, slice_ns % 1_000_000_000)
        while True:
            seen = self._f[word]
            if ready():
                return
            why = self._closed()
            if why is not None:
                raise RingClosedError(f"{what} on {self.path}: {why}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} on {self.path}: nothing moved within the group's timeout")
            syscall(_SYS_FUTEX, addr, _FUTEX_WAIT, ctypes.c_uint32(seen), ctypes.byref(ts), None, 0)

    # ---------------------------------------------------------------- the sender's side

    def free(self) -> int:
        return self.capacity - (int(self._w[_W_HEAD]) - int(self._w[_W_TAIL]))

    def _put(self, src: int, n: int, at: int) -> None:
        """Copy ``n`` bytes from address ``src`` to the ring at byte count ``at`` (wrapping)."""
        pos = at % self.capacity
        first = min(n, self.capacity - pos)
        _memmove(self._data + pos, src, first)
        if n > first:
            _memmove(self._data, src + first, n - first)

    def try_send(self, src: int, n: int, tag: int) -> bool:
        """Copy the whole message (``n`` bytes at address ``src``) now if it fits in the free
        space (False: it does not)."""
        total = _ALIGN + _padded(n)
        if self._pending or total > self.free():
            return False
        head = int(self._w[_W_HEAD])
        pos = head % self.capacity  # messages start 64-aligned, so a header never wraps
        _MSG.pack_into(self._mm, _HEADER + pos, tag, n)
        if n:
            self._put(src, n, head + _ALIGN)
        self._w[_W_HEAD] = head + total
        self._wake(_F_HEAD)
        return True

    def send(self, src: int, n: int, tag: int, deadline: float) -> None:
        """Write one message (``n`` bytes at address ``src``, which must stay valid until this
        returns), streaming it as the receiver frees space when it does not fit at once."""
        if self.try_send(src, n, tag):
            return
        self._wait(lambda: self.free() >= _ALIGN, _F_TAIL, deadline, "send (header)")
        head = int(self._w[_W_HEAD])
        pos = head % self.capacity
        _MSG.pack_into(self._mm, _HEADER + pos, tag, n)
        self._w[_W_HEAD] = head + _ALIGN
        self._wake(_F_HEAD)
        self._pending = n
        self._stream(n, self.free, _F_TAIL, _W_HEAD, _F_HEAD, deadline, "send",
                     lambda done, real, at: self._put(src + done, real, at))
        self._pending = 0

    # ---------------------------------------------------------------- the receiver's side

    def available(self) -> int:
        return int(self._w[_W_HEAD]) - int(self._w[_W_TAIL])

    def _get(self, dst: int, n: int, at: int) -> None:
        pos = at % self.capacity
        first = min(n, self.capacity - pos)
        _memmove(dst, self._data + pos, first)
        if n > first:
            _memmove(dst + first, self._data, n - first)

    def recv(self, dst: int, size: int, tag: int, deadline: float) -> None:
        """Read the next message into the ``size`` bytes at address ``dst``; its tag and size
        must be the ones expected (point-to-point calls are matched in order)."""
        self._wait(lambda: self.available() >= _ALIGN, _F_HEAD, deadline, "recv")
        tail = int(self._w[_W_TAIL])
        pos = tail % self.capacity
        got_tag, n = _MSG.unpack_from(self._mm, _HEADER + pos)
        if n != size or got_tag != tag:
            raise RuntimeError(
                f"recv on {self.path}: the next message is {n} bytes with tag {got_tag}, but the receive "
                f"posted is {size} bytes with tag {tag}: the two ranks' sends and receives disagree "
                "(each receive must match the peer's send of the same order, size and tag)")
        tail += _ALIGN
        if _ALIGN + _padded(n) <= self.available():  # all there: one copy, one release
            if n:
                self._get(dst, n, tail)
            self._w[_W_TAIL] = tail + _padded(n)
            self._wake(_F_TAIL)
            return
        self._w[_W_TAIL] = tail
        self._wake(_F_TAIL)
        self._stream(n, self.available, _F_HEAD, _W_TAIL, _F_TAIL, deadline, "recv",
                     lambda done, real, at: self._get(dst + done, real, at))

    def _stream(self, n: int, room: Any, wait_word: int, counter: int, wake_word: int, deadline: float,
                what: str, move: Any) -> None:
        """Move a message's ``n`` bytes (padded) in pieces as ``room()`` allows: ``move(done,
        bytes, at)`` copies one, then ``counter`` (this side's) advances and the other side wakes."""
        done, total = 0, _padded(n)
        while done < total:
            self._wait(lambda: room() > 0, wait_word, deadline, what)
            k = min(room(), total - done)
            at = int(self._w[counter])
            real = max(0, min(k, n - done))
            if real:
                move(done, real, at)
            self._w[counter] = at + k
            done += k
            self._wake(wake_word)

    # ---------------------------------------------------------------- ending

    def close_link(self) -> None:
        """Mark the ring closed and wake both sides (an aborting rank: the peer raises)."""
        self._w[_W_CLOSED] = 1
        self._wake(_F_HEAD)
        self._wake(_F_TAIL)

    def unlink(self) -> None:
        """Remove the file's name (both ends keep their mapping)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _release(self) -> None:
        self._w.release()
        self._f.release()
        self._mm.close()

    def close(self) -> None:
        """Unmap this end (the ring must not be used after)."""
        self._words.clear()
        del self._base
        try:
            self._release()
        except BufferError:  # a view still alive elsewhere: the mapping goes with it
            pass

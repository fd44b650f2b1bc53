"""A store server with bounds: torch's TCPStore wire protocol, with limits on what it holds.

torch's own TCPStore server caps one value and nothing else: anyone who can connect to the port
can make the hosting process hold any number of keys and bytes (150 values of 7 MiB grow it by
more than 1 GiB). Every value a member reads is signed (`fleetlike.comm.signed_store`), so what a
stranger can still do to a job's store is exhaust its host. This server speaks the same protocol
(torch's ``dist.TCPStore(host, port, is_master=False)`` clients, gloo's and torch's elastic
rendezvous among them, work unchanged) and refuses, by closing the offending connection, any
request that would take it past `StoreLimits`: bytes held, keys held, one value's or key's size,
keys in one request, connections, and bytes buffered for requests not yet complete. The client
whose request is refused gets torch's "connection reset" error on that call; the job's own
requests are never near the limits (the defaults are sized from what a job writes: a few hundred
keys of at most a few KiB each, per rank).

The store's host hands the server its first keys (the job's greeting) before the server serves
anyone: the listening socket takes connections from the moment it is bound, and a client whose
request waits there while the server's process starts must find the greeting, not an empty store
that it would take for a store without its job's secret. (torch's own server starts empty, and
its host writes the greeting a moment later.) The keys the host marks fixed (the greeting's
challenge, the run's nonce) never change or go: a request that would change or delete one is
refused like any other.

The server runs in its own small process (standard library only, no torch): a torch client call
that holds the GIL while it waits for its answer (its queue operations do) would otherwise wait
on a server that needs the same GIL. The process ends when the process that started it ends
(it watches a pipe only the starter holds open) or on `StoreServer.close`.

Example:
    >>> server = StoreServer.start(listen_fd, initial={b"k": b"v"})  # bound and listening
    >>> client = dist.TCPStore(host, server.port, None, False)
"""

from __future__ import annotations

import os
import resource
import selectors
import socket
import struct
import sys
import time
from collections import deque

__all__ = ["StoreLimits", "StoreServer", "serve"]

_VALIDATE_MAGIC = 0x3C85F7CE
# torch's QueryType numbering (TCPStoreBackend.hpp)
(_VALIDATE, _SET, _COMPARE_SET, _GET, _ADD, _CHECK, _WAIT, _NUM_KEYS, _DELETE, _APPEND, _MULTI_GET,
 _MULTI_SET, _CANCEL_WAIT, _PING, _QUEUE_PUSH, _QUEUE_POP, _QUEUE_LEN, _LIST_KEYS, _BARRIER) = range(19)
_STOP_WAITING, _WAIT_CANCELED = b"\x00", b"\x01"
_READY, _NOT_READY = b"\x00", b"\x01"
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_U32 = struct.Struct("<I")
#: bytes charged per key or queued value on top of its own size (the dictionary's share of it)
_ENTRY_COST = 96
#: a reply this large waiting for a slow reader stops the server reading that client's requests
_OUT_HIGH_WATER = 1 << 20
#: seconds a connection may stay without torch's greeting (a client sends it as it connects)
_GREETING_SECONDS = 10.0


class StoreLimits:
    """What one store holds at most. A job's rendezvous writes a few hundred keys of at most a
    few KiB per rank; torch's own server refuses values over 8 MiB as well. (A plain class, not
    a dataclass: the server's process starts on a job's critical path, and importing
    ``dataclasses`` alone would add 10 ms to it.)

    Example:
        >>> StoreLimits(max_total_bytes=64 << 20).max_total_bytes
        67108864
    """

    #: the fields and their defaults
    DEFAULTS = {
        "max_value_bytes": 8 << 20, "max_key_bytes": 4096, "max_keys": 100_000,
        "max_total_bytes": 256 << 20, "max_keys_per_request": 16_384, "max_clients": 16_384,
        "max_buffered_bytes": 64 << 20,
    }
    __slots__ = tuple(DEFAULTS)

    def __init__(self, **given: int) -> None:
        unknown = sorted(set(given) - set(self.DEFAULTS))
        if unknown:
            raise TypeError(f"StoreLimits has no field {unknown[0]!r}; its fields: {', '.join(self.DEFAULTS)}")
        for name, default in self.DEFAULTS.items():
            value = given.get(name, default)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"StoreLimits.{name} must be a positive int, got {value!r}")
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("StoreLimits is read-only: make a new one")

    def __repr__(self) -> str:
        return "StoreLimits(" + ", ".join(f"{n}={getattr(self, n)}" for n in self.DEFAULTS) + ")"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StoreLimits) and all(
            getattr(self, n) == getattr(other, n) for n in self.DEFAULTS)

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, n) for n in self.DEFAULTS))

    def argv(self) -> list[str]:
        return [f"{n}={getattr(self, n)}" for n in self.DEFAULTS]

    @classmethod
    def from_argv(cls, args: list[str]) -> "StoreLimits":
        return cls(**{name: int(value) for name, value in (a.split("=", 1) for a in args)})


class _Refused(Exception):
    """A request that would pass a limit, or is not the protocol: its connection is closed."""


class _Incomplete(Exception):
    """The request continues past the bytes received; ``need`` bytes must be buffered first."""

    def __init__(self, need: int) -> None:
        self.need = need


class _Reader:
    """Parses one request from the front of a buffer, raising `_Incomplete` when it is cut."""

    def __init__(self, buf: bytearray, limits: StoreLimits) -> None:
        self.buf, self.pos, self.limits = buf, 0, limits

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.buf):
            raise _Incomplete(end)
        with memoryview(self.buf) as view:
            out = bytes(view[self.pos:end])  # one copy: the value the store keeps
        self.pos = end
        return out

    def u64(self) -> int:
        return _U64.unpack(self.take(8))[0]

    def i64(self) -> int:
        return _I64.unpack(self.take(8))[0]

    def sized(self, cap: int, what: str) -> bytes:
        n = self.u64()
        if n > cap:
            raise _Refused(f"{what} of {n} bytes is over the store's limit of {cap}")
        return self.take(n)

    def key(self) -> bytes:
        return self.sized(self.limits.max_key_bytes, "a key")

    def value(self) -> bytes:
        return self.sized(self.limits.max_value_bytes, "a value")

    def count(self) -> int:
        n = self.u64()
        if n > self.limits.max_keys_per_request:
            raise _Refused(f"{n} keys in one request is over the store's limit of "
                           f"{self.limits.max_keys_per_request}")
        return n


class _Client:
    def __init__(self, sock: socket.socket, server: "_Server") -> None:
        self.sock, self.server = sock, server
        self.inbuf = bytearray()
        self.need = 1
        self.out: deque[bytes | memoryview] = deque()
        self.out_bytes = 0
        self.validated = False
        self.since = time.monotonic()
        self.awaited = 0       # keys of its pending wait not yet set
        self.barrier: bytes | None = None


class _Store:
    """The keys, queues and waiters, with the byte and key accounting the limits need."""

    def __init__(self, limits: StoreLimits) -> None:
        self.limits = limits
        self.data: dict[bytes, bytes] = {}
        self.queues: dict[bytes, deque[bytes]] = {}
        self.held = 0          # bytes charged for keys, values and queued values
        self.waiting: dict[bytes, list[_Client]] = {}
        self.barriers: dict[bytes, tuple[int, list[_Client]]] = {}
        #: keys that never change or go (the run's greeting: a stranger who read an earlier
        #: run's off the wire cannot put it back, nor delete this run's)
        self.fixed: frozenset[bytes] = frozenset()

    # accounting ----------------------------------------------------------------------------
    def _charge(self, delta: int, new_keys: int) -> None:
        keys = len(self.data) + len(self.queues)  # a queue's key is held as a value's is
        if keys + new_keys > self.limits.max_keys:
            raise _Refused(f"the store holds {keys} keys, its limit is {self.limits.max_keys}")
        if self.held + delta > self.limits.max_total_bytes:
            raise _Refused(f"the store holds {self.held} bytes; {delta} more would pass its limit "
                           f"of {self.limits.max_total_bytes}")
        self.held += delta

    def put(self, key: bytes, value: bytes) -> None:
        if key in self.fixed:
            raise _Refused(f"a request would change the key {key[-64:]!r}, which the store's host "
                           "fixed when it started the store (its greeting)")
        old = self.data.get(key)
        if old is None:
            self._charge(len(key) + len(value) + _ENTRY_COST, 1)
        else:
            self._charge(len(value) - len(old), 0)
        self.data[key] = value
        self.wake(key)

    def delete(self, key: bytes) -> int:
        if key in self.fixed:
            raise _Refused(f"a request would delete the key {key[-64:]!r}, which the store's host "
                           "fixed when it started the store (its greeting)")
        old = self.data.pop(key, None)
        if old is None:
            return 0
        self.held -= len(key) + len(old) + _ENTRY_COST
        return 1

    def ready(self, key: bytes) -> bool:
        return key in self.data or bool(self.queues.get(key))

    # waiters -------------------------------------------------------------------------------
    def wake(self, key: bytes, one: bool = False) -> None:
        clients = self.waiting.get(key)
        while clients:
            client = clients.pop(0)
            client.awaited -= 1
            if client.awaited == 0:
                _send(client, _STOP_WAITING)
                if one:
                    break
        if clients is not None and not clients:
            del self.waiting[key]

    def forget(self, client: _Client) -> None:
        if client.awaited:
            for key in list(self.waiting):
                rest = [c for c in self.waiting[key] if c is not client]
                if rest:
                    self.waiting[key] = rest
                else:
                    del self.waiting[key]
            client.awaited = 0
        if client.barrier is not None:
            count, clients = self.barriers.get(client.barrier, (0, []))
            if client in clients:
                clients.remove(client)
            client.barrier = None


def _send(client: _Client, data: bytes) -> None:
    client.server.dirty.add(client)
    client.out.append(data)
    client.out_bytes += len(data)
    client.server.pending_out += len(data)


def _send_vec(client: _Client, value: bytes) -> None:
    """A value's length, then the value itself: the reply refers to the stored bytes, never a
    copy, so a thousand readers of one large value cost the server one value."""
    _send(client, _U64.pack(len(value)))
    if value:
        _send(client, value)


class _Server:
    """One selector loop: accept, read whole requests, answer them in order."""

    def __init__(self, listener: socket.socket, limits: StoreLimits, watch_fd: int | None) -> None:
        self.listener, self.limits, self.store = listener, limits, _Store(limits)
        self.sel = selectors.DefaultSelector()
        self.clients: dict[int, _Client] = {}
        self.dirty: set[_Client] = set()
        self.buffered = 0      # bytes of requests received but not yet complete
        self.pending_out = 0   # bytes of replies not yet taken by their reader
        listener.setblocking(False)
        self.sel.register(listener, selectors.EVENT_READ, None)
        self.watch_fd = watch_fd
        if watch_fd is not None:
            self.sel.register(watch_fd, selectors.EVENT_READ, "watch")
        self.refusals = 0
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.max_clients = limits.max_clients if soft == resource.RLIM_INFINITY else \
            max(1, min(limits.max_clients, soft - 32))

    def run(self) -> None:
        swept = time.monotonic()
        while True:
            if time.monotonic() - swept > 1.0:
                swept = time.monotonic()
                for client in [c for c in self.clients.values() if not c.validated
                               and swept - c.since > _GREETING_SECONDS]:
                    self._log("closed a connection that never sent torch's greeting")
                    self._close(client)
            for key, events in self.sel.select(1.0):
                if key.data == "watch":
                    return  # a stop from the starter, or it is gone (end of file): so is the job
                if key.data is None:
                    self._accept()
                    continue
                client = key.data
                if events & selectors.EVENT_WRITE and client.sock.fileno() >= 0:
                    self._flush(client)
                    if not client.out and len(client.inbuf) >= client.need:
                        self._serve(client)  # requests held back while a reply drained
                if events & selectors.EVENT_READ and client.sock.fileno() >= 0:
                    self._read(client)
                while self.dirty:  # answers to this client, and wake-ups of waiting ones
                    self._flush(self.dirty.pop())

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # out of descriptors: the clients limit is over the system's
            self._log(f"cannot accept a connection: {exc}")
            return
        if len(self.clients) >= self.max_clients:
            self._log(f"refused a connection: {len(self.clients)} clients are connected, the "
                      f"limit is {self.max_clients}")
            sock.close()
            return
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client = _Client(sock, self)
        self.clients[sock.fileno()] = client
        self.sel.register(sock, selectors.EVENT_READ, client)

    def _close(self, client: _Client) -> None:
        fd = client.sock.fileno()
        if fd < 0:
            return
        self.store.forget(client)
        self.buffered -= len(client.inbuf)
        client.inbuf.clear()
        self.pending_out -= client.out_bytes
        client.out.clear()
        client.out_bytes = 0
        self.dirty.discard(client)
        self.clients.pop(fd, None)
        self.sel.unregister(client.sock)
        client.sock.close()

    def _log(self, what: str) -> None:
        self.refusals += 1
        if self.refusals <= 20 or self.refusals % 1000 == 0:  # a flood does not flood the log
            safe = what.encode("ascii", "backslashreplace").decode("ascii")
            print(f"fleetlike store: {safe} (refusal {self.refusals})", file=sys.stderr, flush=True)

    def _read(self, client: _Client) -> None:
        try:
            data = client.sock.recv(1 << 18)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(client)
            return
        client.inbuf += data
        self.buffered += len(data)
        self._serve(client)
        self._shed()

    def _shed(self) -> None:
        """Past the in-flight bound, close the connection holding the most of it: the job's own
        requests are small and answered at once, so it is a stranger's unfinished request or
        unread replies, not whoever happened to send next."""
        cap = self.limits.max_buffered_bytes
        while self.buffered + self.pending_out > cap and self.clients:
            worst = max(self.clients.values(), key=lambda c: len(c.inbuf) + c.out_bytes)
            self._log(f"closed the connection holding {len(worst.inbuf) + worst.out_bytes} bytes: "
                      f"requests and replies in flight passed {cap} bytes")
            self._close(worst)

    def _serve(self, client: _Client) -> None:
        try:
            while len(client.inbuf) >= client.need and client.out_bytes < _OUT_HIGH_WATER:
                reader = _Reader(client.inbuf, self.limits)
                try:
                    self._request(client, reader)
                except _Incomplete as cut:
                    client.need = cut.need
                    break
                del client.inbuf[:reader.pos]
                self.buffered -= reader.pos
                client.need = 1
        except _Refused as why:
            self._log(f"refused a request and closed its connection: {why}")
            self._close(client)

    def _flush(self, client: _Client) -> None:
        if client.sock.fileno() < 0:
            return
        while client.out:
            head = client.out[0]
            try:
                sent = client.sock.send(head)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._close(client)
                return
            client.out_bytes -= sent
            self.pending_out -= sent
            if sent < len(head):
                client.out[0] = memoryview(head)[sent:]  # the rest, without a copy
                break
            client.out.popleft()
        if client.sock.fileno() < 0:
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if client.out else 0)
        self.sel.modify(client.sock, events, client)

    def _request(self, client: _Client, r: _Reader) -> None:
        op = r.take(1)[0]
        store = self.store
        if not client.validated:
            if op != _VALIDATE or _U32.unpack(r.take(4))[0] != _VALIDATE_MAGIC:
                raise _Refused("a client did not open with torch's TCPStore greeting")
            client.validated = True
        elif op == _PING:
            _send(client, r.take(4))
        elif op == _SET:
            key, value = r.key(), r.value()
            store.put(key, value)
        elif op == _COMPARE_SET:
            key, expected, new = r.key(), r.value(), r.value()
            old = store.data.get(key)
            if old is None:
                if not expected:
                    store.put(key, new)
                    _send_vec(client, new)
                else:
                    _send_vec(client, expected)
                    store.wake(key)
            else:
                if old == expected and new != old:
                    store.put(key, new)
                else:
                    store.wake(key)
                _send_vec(client, store.data[key])
        elif op == _GET:
            _send_vec(client, store.data.get(r.key(), b""))
        elif op == _ADD:
            key, delta = r.key(), r.i64()
            total = self._add(key, delta)
            _send(client, _I64.pack(total))
        elif op in (_CHECK, _WAIT):
            keys = [r.key() for _ in range(r.count())]
            if all(store.ready(k) for k in keys):
                _send(client, _READY if op == _CHECK else _STOP_WAITING)
            elif op == _CHECK:
                _send(client, _NOT_READY)
            else:
                self._wait(client, [k for k in keys if not store.ready(k)])
        elif op == _NUM_KEYS:
            _send(client, _I64.pack(len(store.data)))
        elif op == _DELETE:
            _send(client, _I64.pack(store.delete(r.key())))
        elif op == _APPEND:
            key, value = r.key(), r.value()
            old = store.data.get(key, b"")
            if len(old) + len(value) > self.limits.max_value_bytes:
                raise _Refused(f"appending {len(value)} bytes to a value of {len(old)} would pass "
                               f"the store's limit of {self.limits.max_value_bytes} per value")
            store.put(key, old + value)
        elif op == _MULTI_GET:
            keys = [r.key() for _ in range(r.count())]
            for k in keys:
                _send_vec(client, store.data.get(k, b""))
        elif op == _MULTI_SET:
            pairs = [(r.key(), r.value()) for _ in range(r.count())]
            for k, v in pairs:
                store.put(k, v)
        elif op == _CANCEL_WAIT:
            store.forget(client)
            _send(client, _WAIT_CANCELED)
        elif op == _QUEUE_PUSH:
            key, value = r.key(), r.value()
            new = key not in store.queues
            store._charge(len(value) + _ENTRY_COST + (len(key) if new else 0), int(new))
            store.queues.setdefault(key, deque()).append(value)
            store.wake(key, one=True)
        elif op == _QUEUE_POP:
            key = r.key()
            queue = store.queues.get(key)
            if queue:
                value = queue.popleft()
                store.held -= len(value) + _ENTRY_COST
                if not queue:  # an emptied queue goes with its key's charge, as a deleted key
                    del store.queues[key]
                    store.held -= len(key)
                _send(client, _I64.pack(len(queue) + 1))
                _send_vec(client, value)
            else:
                _send(client, _I64.pack(0))
        elif op == _QUEUE_LEN:
            _send(client, _I64.pack(len(store.queues.get(r.key(), ()))))
        elif op == _LIST_KEYS:
            # sized before it is built: the reply must not outgrow what one client may have
            # waiting for it (the bound on buffered bytes acts only once a reply exists)
            size = 8 + sum(8 + len(k) for k in store.data)
            if size > self.limits.max_buffered_bytes:
                raise _Refused(f"listing the store's {len(store.data)} keys takes {size} bytes, more "
                               f"than one client may have waiting ({self.limits.max_buffered_bytes})")
            keys = list(store.data)
            _send(client, _I64.pack(len(keys)) + b"".join(_U64.pack(len(k)) + k for k in keys))
        elif op == _BARRIER:
            key, world = r.key(), r.i64()
            self._barrier(client, key, world)
        else:
            raise _Refused(f"unknown request type {op}")

    def _add(self, key: bytes, delta: int) -> int:
        old = self.store.data.get(key)
        try:
            total = delta + (int(old.decode("ascii")) if old is not None else 0)
        except (UnicodeDecodeError, ValueError):
            raise _Refused(f"add on a key whose value is not a number ({old[:32]!r})") from None
        if not -(1 << 63) <= total < (1 << 63):
            raise _Refused("add would overflow a 64-bit counter")
        self.store.put(key, str(total).encode("ascii"))
        return total

    def _wait(self, client: _Client, keys: list[bytes]) -> None:
        self.store.forget(client)
        client.awaited = len(keys)
        for k in keys:
            self.store.waiting.setdefault(k, []).append(client)

    def _barrier(self, client: _Client, key: bytes, world: int) -> None:
        arrived = self._add(key, 1)
        if arrived >= world:
            _, clients = self.store.barriers.pop(key, (0, []))
            for waiter in clients:
                waiter.barrier = None
                _send(waiter, _STOP_WAITING)
            _send(client, _STOP_WAITING)
        else:
            _, clients = self.store.barriers.setdefault(key, (world, []))
            clients.append(client)
            client.barrier = key


def _pack_initial(initial: dict[bytes, bytes], fixed: frozenset[bytes]) -> bytes:
    return b"".join(_U64.pack(len(k)) + k + _U64.pack(len(v)) + v + (b"\x01" if k in fixed else b"\x00")
                    for k, v in initial.items())


def _unpack_initial(data: bytes, limits: StoreLimits) -> tuple[dict[bytes, bytes], frozenset[bytes]]:
    reader, out, fixed = _Reader(bytearray(data), limits), {}, set()
    try:
        while reader.pos < len(data):
            key = reader.key()
            out[key] = reader.value()
            if reader.take(1) == b"\x01":
                fixed.add(key)
    except (_Incomplete, _Refused) as exc:
        raise ValueError(f"the store's first keys are cut or over its limits ({exc!r})") from None
    return out, frozenset(fixed)


def _read_all(fd: int) -> bytes:
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def serve(listen_fd: int, limits: StoreLimits, watch_fd: int | None = None,
          initial: dict[bytes, bytes] | None = None, fixed: frozenset[bytes] = frozenset()) -> None:
    """Serve on the listening socket ``listen_fd`` until ``watch_fd`` becomes readable (EOF),
    holding ``initial`` from before the first request is read; the keys of ``fixed`` among them
    never change (a request that would change or delete one is refused)."""
    # every member holds a connection or two: let the descriptor limit, not the soft default of
    # 1024, bound them with the clients limit
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = limits.max_clients + 64 if hard == resource.RLIM_INFINITY else min(hard, limits.max_clients + 64)
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    listener = socket.socket(fileno=listen_fd)
    server = _Server(listener, limits, watch_fd)
    for key, value in (initial or {}).items():
        server.store.put(key, value)
    server.store.fixed = frozenset(fixed) & frozenset(initial or {})
    server.run()


class StoreServer:
    """A bounded store server in its own process, serving a socket the caller bound.

    Example:
        >>> server = StoreServer.start(fd)   # fd: bound and listening; the server owns it now
        >>> server.close()
    """

    def __init__(self, proc: "subprocess.Popen[bytes]", pipe_w: int, port: int) -> None:
        self.proc, self._pipe_w, self.port = proc, pipe_w, port
        # a process forked from the starter (ranks a test forks, say) inherits this object and
        # the pipe: only the starter stops the server
        self._owner = os.getpid()

    @classmethod
    def start(cls, listen_fd: int, limits: StoreLimits | None = None, *,
              initial: dict[bytes, bytes] | None = None, fixed: tuple[bytes, ...] = ()) -> "StoreServer":
        """Serve ``listen_fd`` (bound and listening; the server's process owns it from here on)
        in a process of its own, holding ``initial`` (key -> value) before it answers anyone; the
        keys of ``fixed`` among them never change or go."""
        import subprocess  # here, not at the top: the server's own process never needs it

        limits = limits or StoreLimits()
        port = socket.socket(fileno=os.dup(listen_fd))
        try:
            bound = port.getsockname()[1]
        finally:
            port.close()
        pipe_r, pipe_w = os.pipe()
        os.set_inheritable(pipe_w, False)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", os.path.abspath(__file__), str(listen_fd), str(pipe_r),
                 *limits.argv()],
                pass_fds=(listen_fd, pipe_r), stdin=subprocess.PIPE, close_fds=True,
                # large values are mapped on their own, so a value deleted or refused goes back
                # to the system instead of staying in the heap at its peak
                env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"})
        except BaseException:  # no process: nobody will read the stop pipe either
            os.close(pipe_w)
            raise
        finally:
            os.close(pipe_r)
            os.close(listen_fd)  # the server's process holds the listening socket now
        try:  # a few hundred bytes: the pipe's buffer takes them at once
            proc.stdin.write(_pack_initial(initial or {}, frozenset(fixed)))
            proc.stdin.close()
        except OSError as exc:  # the process could not start its interpreter
            os.close(pipe_w)
            proc.kill()
            proc.wait()
            raise OSError(f"the store server's process ended as it started ({exc})") from None
        return cls(proc, pipe_w, bound)

    def close(self) -> None:
        """Stop the server (its clients see the connection close). A stop byte, not only the
        pipe's end: forked children of the starter hold the pipe open as well."""
        if self._pipe_w < 0:
            return
        if os.getpid() != self._owner:
            os.close(self._pipe_w)
            self._pipe_w = -1
            return
        try:
            os.write(self._pipe_w, b"x")
        except OSError:
            pass  # the server is gone already
        os.close(self._pipe_w)
        self._pipe_w = -1
        try:
            self.proc.wait(5)
        except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: it did not stop, so end it
            self.proc.kill()
            self.proc.wait()

    @property
    def pid(self) -> int:
        return self.proc.pid


if __name__ == "__main__":
    import signal

    # Ctrl-C, a hang-up or a TERM to the host's process group is the host's to handle (a
    # launcher winding down still reads the store); this process ends when the host does
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    _limits = StoreLimits.from_argv(sys.argv[3:])
    # the first keys come on standard input, and are all there before the first request is read
    serve(int(sys.argv[1]), _limits, int(sys.argv[2]), *_unpack_initial(_read_all(0), _limits))

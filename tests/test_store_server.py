"""The bounded store server: torch's own TCPStore clients see the same answers as from torch's
server, and a stranger's flood is refused with the server's memory staying bounded (measured)."""

from __future__ import annotations

import datetime
import socket
import struct
import threading
import time

import pytest
import torch.distributed as dist

from fleetlike.comm.store_server import StoreLimits, StoreServer

_T = datetime.timedelta


def _listen() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock.detach()


def _client(port: int, seconds: float = 5.0) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, None, False, _T(seconds=seconds))


def _operations(port: int) -> list:
    """Every request type torch's client sends, on two clients, with what each call returned."""
    cl, cl2 = _client(port), _client(port)
    out: list = []
    cl.set("k", "v1")
    out += [cl.get("k"), cl.add("c", 3), cl.add("c", -5)]
    out += [cl.compare_set("k", "v1", "v2"), cl.compare_set("k", "zz", "v3"),
            cl.compare_set("nx", "e", "v2"), cl.compare_set("nx2", "", "v2")]
    out += [cl.check(["k", "zz"]), cl.check(["k"]), cl.num_keys(), cl.delete_key("k"), cl.delete_key("k")]
    cl.append("a", "x")
    cl.append("a", "yz")
    out += [cl.get("a"), cl.multi_get(["a", "c"])]
    cl.multi_set(["m1", "m2"], ["1", "2"])
    out.append(cl.multi_get(["m1", "m2"]))
    cl.wait(["a"])
    cl.queue_push("q", "hello")
    out += [cl.queue_len("q"), cl.queue_pop("q", block=False)]
    with pytest.raises(dist.QueueEmptyError):
        cl.queue_pop("q", block=False)
    popped: list = []
    t = threading.Thread(target=lambda: popped.append(cl.queue_pop("q2")), daemon=True)
    t.start()
    time.sleep(0.2)
    cl2.queue_push("q2", "hi")
    t.join(5)
    out.append(popped)
    t = threading.Thread(target=lambda: cl.wait(["w1", "w2"]), daemon=True)
    t.start()
    cl2.set("w1", "1")
    time.sleep(0.2)
    out.append(t.is_alive())  # one of two keys set: still waiting
    cl2.add("w2", 1)
    t.join(5)
    out.append(t.is_alive())
    t = threading.Thread(target=lambda: cl.barrier("b", 2, _T(seconds=5)), daemon=True)
    t.start()
    time.sleep(0.2)
    cl2.barrier("b", 2, _T(seconds=5))
    t.join(5)
    out.append(t.is_alive())
    with pytest.raises(dist.DistStoreError):
        cl.barrier("bt", 2, _T(seconds=0.3))
    with pytest.raises(dist.DistStoreError):
        cl.wait(["nokey"], _T(seconds=0.3))
    cl.set("after", "1")  # the connection is usable after a cancelled wait
    out += [cl.get("after"), cl.get("bt"), cl.get("b"), sorted(cl.list_keys()), cl.num_keys()]
    return out


def test_every_operation_answers_as_torchs_own_server() -> None:
    theirs = dist.TCPStore("127.0.0.1", 0, None, True, _T(seconds=5), wait_for_workers=False)
    expected = _operations(theirs.port)
    server = StoreServer.start(_listen())
    try:
        assert _operations(server.port) == expected
    finally:
        server.close()


def _rss_peak_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def _raw_set(port: int, key: bytes, value: bytes) -> bool:
    """A stranger's set over a raw socket; False when the server closed the connection."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        frame = (b"\x00" + struct.pack("<I", 0x3C85F7CE) + b"\x01" + struct.pack("<Q", len(key)) + key
                 + struct.pack("<Q", len(value)) + value + b"\x07")  # set, then num_keys
        try:
            s.sendall(frame)
            return len(s.recv(8)) == 8
        except OSError:
            return False


def test_a_strangers_flood_is_refused_and_the_servers_memory_stays_bounded() -> None:
    limits = StoreLimits(max_total_bytes=64 << 20)
    server = StoreServer.start(_listen(), limits)
    try:
        member = _client(server.port)
        member.set("mine", "kept")
        time.sleep(0.2)
        base = _rss_peak_kib(server.pid)
        value = b"x" * (7 << 20)
        accepted = sum(_raw_set(server.port, b"/flood%d" % i, value) for i in range(40))  # 280 MiB
        grown_mib = (_rss_peak_kib(server.pid) - base) / 1024
        assert accepted == 9  # 9 x 7 MiB fit in 64 MiB, the rest are refused
        # held bytes at most the limit; the refused requests were buffered one at a time
        assert grown_mib < 64 + 2 * 8 + 16, grown_mib
        assert member.get("mine") == b"kept"  # the job's own client is unharmed
        member.set("mine", "still")
        assert member.get("mine") == b"still"
    finally:
        server.close()


def test_too_many_keys_and_too_large_values_are_refused_to_their_client() -> None:
    server = StoreServer.start(_listen(), StoreLimits(max_keys=50, max_value_bytes=1 << 16))
    try:
        stranger = _client(server.port)
        for i in range(50):
            stranger.set(f"k{i}", "v")
        stranger.set("one-more", "v")  # a set has no answer: its refusal shows on the next call
        with pytest.raises(dist.DistError) as refused:
            stranger.num_keys()
        assert isinstance(refused.value, dist.DistNetworkError)  # closed or reset, as the race goes
        big = _client(server.port)
        big.set("k0", b"x" * (1 << 17))
        with pytest.raises(dist.DistError):
            big.get("k0")
        member = _client(server.port)
        assert member.num_keys() == 50 and member.get("k0") == b"v"
        member.delete_key("k1")
        member.set("room", "again")  # a deleted key frees its place
        assert member.get("room") == b"again"
    finally:
        server.close()


def test_emptied_queues_give_their_place_back_and_count_as_keys() -> None:
    # 600 distinct queues pushed and popped hold nothing: the byte limit must not fill up
    server = StoreServer.start(_listen(), StoreLimits(max_total_bytes=50_000, max_keys=100))
    try:
        member = _client(server.port)
        for i in range(600):
            key = f"q{i:04d}" + "k" * 95
            member.queue_push(key, b"v")
            assert member.queue_pop(key, block=False) == b"v"
        member.set("after", "ok")
        assert member.get("after") == b"ok"
        for i in range(99):  # 1 key + 99 queues: the limit of 100 keys
            member.queue_push(f"held{i}", b"v")
        stranger = _client(server.port)
        stranger.queue_push("one-more", b"v")  # no answer of its own: refused on the next call
        with pytest.raises(dist.DistError):
            stranger.num_keys()
        assert _client(server.port).queue_len("held0") == 1
    finally:
        server.close()


def test_a_key_listing_larger_than_a_clients_buffer_is_refused_and_the_store_goes_on() -> None:
    server = StoreServer.start(_listen(), StoreLimits(max_buffered_bytes=4096))
    try:
        member = _client(server.port)
        for i in range(20):
            member.set(f"key{i:03d}" + "x" * 200, "v")
        with pytest.raises(dist.DistError):
            member.list_keys()
        assert _client(server.port).get("key000" + "x" * 200) == b"v"  # the store goes on
    finally:
        server.close()


def test_the_server_ends_when_closed_and_refuses_bad_limits() -> None:
    server = StoreServer.start(_listen())
    server.close()
    assert server.proc.returncode == 0
    with pytest.raises(ValueError, match="max_keys"):
        StoreLimits(max_keys=0)


def test_closing_stops_the_server_at_once_while_a_forked_child_holds_its_pipe() -> None:
    import os

    server = StoreServer.start(_listen())
    child = os.fork()
    if child == 0:  # a rank forked from the host: it inherits the pipe, never stops the server
        server.close()
        time.sleep(3)
        os._exit(0)
    try:
        time.sleep(0.2)
        assert _client(server.port).num_keys() == 0  # the child's close stopped nothing
        t0 = time.monotonic()
        server.close()
        assert time.monotonic() - t0 < 1.0 and server.proc.returncode == 0
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)


def test_past_the_in_flight_bound_the_connection_holding_most_is_closed_not_the_members() -> None:
    server = StoreServer.start(_listen(), StoreLimits(max_buffered_bytes=1 << 20))
    try:
        member = _client(server.port)
        strangers = []
        for size in (700 << 10, 500 << 10):  # two unfinished sets of 900 KiB: 1.2 MiB in flight
            s = socket.create_connection(("127.0.0.1", server.port))
            s.sendall(b"\x00" + struct.pack("<I", 0x3C85F7CE) + b"\x01" + struct.pack("<Q", 2) + b"/x"
                      + struct.pack("<Q", 900 << 10) + b"y" * size)
            strangers.append(s)
        time.sleep(0.3)
        member.set("mine", "kept")
        assert member.get("mine") == b"kept"
        strangers[0].settimeout(5)
        try:
            assert strangers[0].recv(1) == b""  # the larger one was closed
        except ConnectionResetError:
            pass
        strangers[1].setblocking(False)
        with pytest.raises(BlockingIOError):  # the smaller one is still connected
            strangers[1].recv(1)
    finally:
        for s in strangers:
            s.close()
        server.close()


def test_host_store_serves_with_the_bounded_server_unless_torchs_is_asked_for(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """By default (and with ``FLEETLIKE_STORE_SERVER=bounded``) the job's store is this server (a
    5 KiB key, which torch's own server holds, is refused); ``torch`` gives torch's; a value that
    names no server is refused before a port is taken."""
    from fleetlike.comm.rendezvous import RendezvousError, host_store

    for value in (None, "bounded", " Bounded "):
        if value is None:
            monkeypatch.delenv("FLEETLIKE_STORE_SERVER", raising=False)
        else:
            monkeypatch.setenv("FLEETLIKE_STORE_SERVER", value)
        store = host_store("127.0.0.1", "job", timeout=10)
        store.set("mine", "kept")
        assert store.get("mine") == b"kept"
        assert not _raw_set(store.port, b"/" + b"k" * 5000, b"v")
        assert store.get("mine") == b"kept"
    monkeypatch.setenv("FLEETLIKE_STORE_SERVER", "torch")
    assert _raw_set(host_store("127.0.0.1", "job", timeout=10).port, b"/" + b"k" * 5000, b"v")
    monkeypatch.setenv("FLEETLIKE_STORE_SERVER", "fast")
    with pytest.raises(RendezvousError, match="FLEETLIKE_STORE_SERVER='fast' is not a store server"):
        host_store("127.0.0.1", "job", timeout=10)

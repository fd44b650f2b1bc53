"""The `nccl` backend: clear errors without a GPU; on a GPU, every collective against numpy.

The CPU tests always run. The GPU tests (marked ``gpu``) need a CUDA device, CuPy and NCCL and are
skipped, with the reason, without them. One GPU means a world of one process: NCCL refuses two
ranks on one device. The base class would short-cut a group of one, so the nccl backend sets
``calls_backend_at_size_one`` and every call below really goes through NCCL on the comm stream.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import itertools
import json
import os
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import fleetlike.comm.nccl as nccl_mod
import fleetlike.comm.nccl_setup as nccl_setup
import fleetlike.comm.nccl_watch as nccl_watch
import fleetlike.comm.nccl_work as nccl_work
from comm_cases import DTYPES, KINDS, OPS, Case, case_strategy, check_all, run_cases
from fleetlike.comm import CommError, SingleCommunicator, create_world
from fleetlike.comm.nccl import NcclCommunicator
from fleetlike.comm.nccl_setup import NcclUnavailableError, nccl_unavailable_reason
from fleetlike.roles.role import Role
from fleetlike.testing import hosted_job

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def _one_rank_role() -> Iterator[Role]:
    """The role of a world of one whose store this process hosts (no port picked and handed on)."""
    with hosted_job(1, 1, job_id="nccl-test") as job:
        yield job.role(0)


# ------------------------------------------------------------------------- CPU: always run


def test_module_imports_without_cupy():
    """The module and the package import with CuPy unimportable, and do not import CuPy."""
    code = (
        "import sys\n"
        "import fleetlike.comm.nccl as m, fleetlike.comm.nccl_setup as s, fleetlike.comm\n"
        "assert 'cupy' not in sys.modules, 'importing the backend imported cupy'\n"
        "sys.modules['cupy'] = None\n"
        "print(m.NcclCommunicator.backend, s.NcclUnavailableError.__mro__[1].__name__)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["nccl", "CommError"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_create_world_nccl_without_gpu_says_why_and_what_to_do():
    with _one_rank_role() as role, pytest.raises(NcclUnavailableError) as info:
        create_world(role, backend="nccl", timeout=30)
    msg = str(info.value)
    assert info.value.reason == "no_cuda"
    assert isinstance(info.value, CommError) and isinstance(info.value, RuntimeError)
    assert "torch.cuda.is_available() is False" in msg
    assert "backend='gloo'" in msg and "nvidia-smi" in msg
    assert nccl_unavailable_reason() == msg


def _pretend_cuda(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(nccl_setup, "_NCCL", None)


def test_missing_cupy_names_the_gpu_extra(monkeypatch):
    _pretend_cuda(monkeypatch)
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    with pytest.raises(NcclUnavailableError) as info:
        nccl_setup.require_nccl()
    assert info.value.reason == "no_cupy"
    assert "pip install 'fleetlike[gpu]'" in str(info.value) and "backend='gloo'" in str(info.value)


def test_missing_nccl_library_names_the_package(monkeypatch):
    _pretend_cuda(monkeypatch)
    cupy = types.ModuleType("cupy")
    cupy.__version__ = "13.0.0"
    cuda = types.ModuleType("cupy.cuda")
    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.available = False
    cupy.cuda, cuda.nccl = cuda, nccl
    for name, mod in (("cupy", cupy), ("cupy.cuda", cuda), ("cupy.cuda.nccl", nccl)):
        monkeypatch.setitem(sys.modules, name, mod)
    with pytest.raises(NcclUnavailableError) as info:
        nccl_setup.require_nccl()
    assert info.value.reason == "no_nccl"
    assert "nvidia-nccl-cu12" in str(info.value) and "nvidia-smi" in str(info.value)


def test_device_from_explicit_device_selected_gpus_or_local_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    resolve = nccl_setup.resolve_device
    eps = ["127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003"]
    assert resolve(Role.from_endpoints(1, eps[:2]), None) == torch.device("cuda", 1)
    assert resolve(Role.from_endpoints(0, eps[:1], selected_gpus=[1]), None) == torch.device("cuda", 1)
    assert resolve(Role.from_endpoints(1, eps[:2], selected_gpus=[1, 0]), None) == torch.device("cuda", 0)
    assert resolve(Role.from_endpoints(1, eps[:2]), "cuda:0") == torch.device("cuda", 0)
    assert resolve(Role.from_endpoints(0, eps[:1]), 1) == torch.device("cuda", 1)
    with pytest.raises(NcclUnavailableError, match=r"GPU 2 \(from local_rank=2\).*sees 2 CUDA") as info:
        resolve(Role.from_endpoints(2, eps), None)
    assert info.value.reason == "no_device" and "--selected_gpus" in str(info.value)
    with pytest.raises(ValueError, match="has no entry for local rank 2"):
        resolve(Role.from_endpoints(2, eps, selected_gpus=[0, 1]), None)
    with pytest.raises(ValueError, match="runs on a CUDA device"):
        resolve(Role.from_endpoints(0, eps[:1]), "cpu")


def test_unique_id_travels_as_raw_bytes():
    uid = tuple((i * 37 % 256) - 128 for i in range(128))  # CuPy's signed chars
    raw = nccl_setup.uid_to_bytes(uid)
    assert isinstance(raw, bytes) and len(raw) == 128
    assert nccl_setup.uid_candidates(raw) == [raw, uid, tuple(v & 0xFF for v in uid)]
    # CuPy >= 14 hands the id over as bytes: the same raw bytes reach the store
    assert nccl_setup.uid_to_bytes(raw) == raw


def test_exports():
    assert nccl_mod.__all__ == ["NcclCommunicator"]
    assert {"NcclUnavailableError", "nccl_unavailable_reason"} <= set(nccl_setup.__all__)
    for module in (nccl_mod, nccl_setup, nccl_watch, nccl_work):
        assert module.__doc__ and all(hasattr(module, name) for name in module.__all__), module.__name__


def test_group_is_a_no_op_elsewhere_and_size_one_short_cut_stays():
    comm = SingleCommunicator()
    with comm.group():
        work = comm.all_reduce_async(torch.ones(3))
    assert torch.equal(work.wait(), torch.ones(3))
    assert SingleCommunicator.calls_backend_at_size_one is False
    assert NcclCommunicator.calls_backend_at_size_one is True


# ------------------------------------------------------------------------- CPU: a fake NCCL
# The backend's own logic (unique id through the store, streams and events, group deferral,
# integer AVG, split, the size-one path of the base class) run against a stand-in for CuPy's
# binding on CPU memory, with torch.cuda's stream and event calls replaced by recorders. This is
# what CI can check without a GPU; the GPU tests below check the real thing.

_SIZES = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2}
_NP = {2: np.int32, 4: np.int64, 7: np.float32, 8: np.float64}


def _view(ptr: int, count: int, dtype: int) -> np.ndarray:
    raw = (ctypes.c_char * (count * _SIZES[dtype])).from_address(ptr)
    return np.frombuffer(raw, dtype=_NP.get(dtype, np.uint8))


class _FakeNccl(types.ModuleType):
    """CuPy's nccl module, on CPU pointers. ``ndev == 2`` mirrors a peer holding the same data."""

    available = True
    NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = range(5)
    (NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64, NCCL_FLOAT16,
     NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16) = range(10)

    class NcclError(RuntimeError):
        def __init__(self, status=None, message=""):
            super().__init__(message or f"NCCL error {status}")
            self.status = status

    def __init__(self, uid_type: type = tuple):
        super().__init__("cupy.cuda.nccl")
        self.depth, self.queued, self.log, self.uids = 0, [], [], []
        self.errors: dict = {}  # rank -> what check_async_error raises
        self.peer_numel = 0  # added to the mirrored peer's element count in a size check's rows
        self.uid_type = uid_type  # tuple of signed chars (CuPy < 14) or bytes (CuPy >= 14)
        fake = self

        class NcclCommunicator:
            def __init__(self, ndev, uid, rank):
                if not isinstance(uid, fake.uid_type):  # what Cython's typed argument raises
                    raise TypeError(f"Argument 'commId' has incorrect type (got {type(uid)})")
                assert len(uid) == 128 and 0 <= rank < ndev
                fake.uids.append(uid)
                self.ndev, self.rank = ndev, rank

            def check_async_error(self):
                """``ncclCommGetAsyncError``: what `errors` holds for this rank (a status and
                message, or CuPy 13's KeyError for ncclInProgress)."""
                error = fake.errors.get(self.rank)
                if isinstance(error, BaseException):
                    raise error
                if error is not None:
                    raise fake.NcclError(*error)

            def _do(self, name, fn, stream=None):
                fake.log.append(name)
                cuda = getattr(fake, "cuda", None)
                if cuda is not None and stream is not None:
                    cuda.kernel(f"nccl:{name}", cuda.streams[stream])
                (fake.queued.append if fake.depth else lambda f: f())(fn)

            def _copy(self, name, src, dst, nbytes, stream=None):
                self._do(name, lambda: ctypes.memmove(dst, src, nbytes) if src != dst else None, stream)

            def allReduce(self, s, r, n, t, op, stream):
                if self.ndev == 1:
                    return self._copy("allReduce", s, r, n * _SIZES[t], stream)

                def mirror():
                    x = _view(s, n, t).copy()
                    _view(r, n, t)[:] = {0: x + x, 1: x * x, 2: x, 3: x, 4: x}[op]
                self._do("allReduce", mirror, stream)

            def broadcast(self, s, r, n, t, root, stream):
                self._copy("broadcast", s, r, n * _SIZES[t], stream)

            def reduce(self, s, r, n, t, op, root, stream):
                self._copy("reduce", s, r, n * _SIZES[t], stream)

            def allGather(self, s, r, n, t, stream):
                nbytes, ndev = n * _SIZES[t], self.ndev

                def mirror():  # every (mirrored) peer contributes the same chunk
                    for i in range(ndev):
                        if s != r + i * nbytes:
                            ctypes.memmove(r + i * nbytes, s, nbytes)
                    if fake.peer_numel and t == fake.NCCL_INT64 and ndev > 1:  # a size check's rows
                        _view(r + nbytes, n, t)[6] += fake.peer_numel  # the peer passes another size
                self._do("allGather", mirror, stream)

            def reduceScatter(self, s, r, n, t, op, stream):
                self._copy("reduceScatter", s, r, n * _SIZES[t], stream)

            def destroy(self):
                fake.log.append("destroy")

            def abort(self):
                fake.log.append("abort")

        self.NcclCommunicator = NcclCommunicator

    def get_version(self):
        return 22703

    def get_unique_id(self):
        uid = tuple(range(-64, 64))
        return self.uid_type(v & 0xFF for v in uid) if self.uid_type is bytes else uid

    def groupStart(self):
        self.depth += 1

    def groupEnd(self):
        self.depth -= 1
        if not self.depth:
            queued, self.queued = self.queued, []
            for fn in queued:
                fn()


class _FakeCuda:
    """torch.cuda's streams, events and devices on the CPU, recording each call.

    ``log`` holds ``(op, stream, what, device, thread)``: ``op`` is "kernel" (a named piece of
    GPU work: NCCL's calls, or a test's own), "record" or "wait" (an event on a stream),
    "query" (an event polled) or "set_device"; ``device`` is the calling thread's current
    device then. `deps` replays the log with CUDA's ordering rules (work on one stream runs in
    order; a wait orders a stream after everything before the event's record), so a test
    asks what a kernel is guaranteed to run after.
    """

    def __init__(self) -> None:
        self.log: list[tuple[str, str, str, int, str]] = []
        self.local = threading.local()
        self.streams: dict[int, _FakeStream] = {}
        self.default = _FakeStream(self, "default")
        self.events = itertools.count()

    def device(self) -> int:
        return getattr(self.local, "device", 0)

    def current(self) -> _FakeStream:
        return getattr(self.local, "stream", self.default)

    def note(self, op: str, stream: str, what: str) -> None:
        self.log.append((op, stream, what, self.device(), threading.current_thread().name))

    def kernel(self, what: str, stream: _FakeStream | None = None) -> None:
        self.note("kernel", (stream or self.current()).name, what)

    def set_device(self, index) -> None:
        self.local.device = int(getattr(index, "index", index))
        self.note("set_device", "-", str(self.local.device))

    @contextlib.contextmanager
    def stream(self, s):
        old = self.current()
        self.local.stream = s
        try:
            yield
        finally:
            self.local.stream = old

    def deps(self, at: int) -> set[int]:
        """The log positions of the kernels that the kernel at log position ``at`` surely runs
        after."""
        cover: dict[str, set[int]] = {}
        marks: dict[str, set[int]] = {}
        for i, (op, stream, what, _, _) in enumerate(self.log[: at + 1]):
            mine = cover.setdefault(stream, set())
            if op == "kernel":
                if i == at:
                    return set(mine)
                mine.add(i)
            elif op == "record":
                marks[what] = set(mine)
            elif op == "wait":
                mine |= marks.get(what, set())
        raise AssertionError(f"log position {at} is past the log")

    def find(self, prefix: str, start: int = 0) -> list[int]:
        """Log positions (from ``start``) of the kernels whose names start with ``prefix``."""
        return [i for i, (op, _, w, _, _) in enumerate(self.log) if i >= start and op == "kernel" and w.startswith(prefix)]


class _FakeStream:
    def __init__(self, cuda: _FakeCuda | None = None, name: str | None = None, **kw):
        self.cuda = cuda if cuda is not None else _CUDA[0]
        self.cuda_stream = 1000 + len(self.cuda.streams)
        self.name = name or f"s{self.cuda_stream}"
        self.cuda.streams[self.cuda_stream] = self

    def wait_stream(self, other):
        e = _FakeEvent()
        e.record(other)
        self.wait_event(e)

    def wait_event(self, event):
        self.cuda.note("wait", self.name, event.name)

    def synchronize(self):
        pass

    def query(self):
        return True


_CUDA: list[_FakeCuda] = []  # the fake in use (streams and events find it here)


class _FakeEvent:
    def __init__(self, *a, **kw):
        self.cuda = _CUDA[0]
        self.name = f"e{next(self.cuda.events)}"

    def record(self, stream=None):
        # an event's calls go to the fake of its stream (or its own): a helper thread of an
        # earlier test may record or poll late, after the next test has made a fake of its own
        cuda = stream.cuda if stream is not None else self.cuda
        cuda.note("record", (stream or cuda.current()).name, self.name)
        self.recorded = True

    def query(self):
        self.cuda.note("query", "-", self.name)
        return True

    def synchronize(self):
        pass


@pytest.fixture
def fake(monkeypatch):
    """A fake NCCL and torch.cuda's stream API on the CPU; yields a factory of communicators."""
    import fleetlike.comm.cuda as cuda_mod

    nccl = _FakeNccl()
    cuda = _FakeCuda()
    _CUDA[:] = [cuda]
    nccl.cuda = cuda
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: cuda.current())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", cuda.stream)
    monkeypatch.setattr(torch.cuda, "set_device", cuda.set_device)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)
    monkeypatch.setattr(cuda_mod, "dedicated_stream", lambda device: (_FakeStream(cuda), None))
    monkeypatch.setattr(cuda_mod, "_THREAD", threading.local())  # no thread has set a device yet
    # torch's C stream query (CUDA builds) would bypass the fake current_stream and cache fake
    # Stream objects for the real GPU tests after these (seen on the first GPU run)
    monkeypatch.setattr(nccl_work, "_GET_CURRENT_STREAM", None)

    def make(size: int = 1, rank: int = 0, device: str = "cpu", store=None) -> NcclCommunicator:
        store = store if store is not None else dist.PrefixStore("nccl/world/", dist.HashStore())
        if device != "cpu":  # CPU tensors stand in for the device's (in its splits too)
            monkeypatch.setattr(NcclCommunicator, "_check_device", lambda *a: None)
        return NcclCommunicator._connect(nccl, store, rank, size, range(size), "world", torch.device(device), 10)

    make.nccl = nccl
    make.cuda = cuda
    yield make
    from fleetlike.comm.watchdog import WATCHDOG
    WATCHDOG.clear()


def _through(cuda: _FakeCuda, label: str, start, wait=None, caller: bool = False, same: bool = False) -> None:
    """Gradients made on a side stream go through ``start()`` (a helper path or not); the
    consumer, on another stream, waits and reads. Every NCCL kernel must run after the
    gradients, the read after every NCCL kernel, and no helper thread may hold back a stream
    that is not its own. ``caller``: the gradients are made and ``start()`` runs on a thread of
    the caller's own (as autograd's), whose device fleetlike has not set. ``same``: the
    consumer is the producer's thread and stream (a backward and the step after it)."""
    producer = _FakeStream(cuda, f"producer-{label}")
    consumer = producer if same else _FakeStream(cuda, f"consumer-{label}")
    first = len(cuda.log)
    got: list = []

    def consume(work) -> None:
        (wait or (lambda w: w.wait()))(work)
        cuda.kernel(f"read:{label}")

    def produce() -> None:
        with cuda.stream(producer):
            cuda.kernel(f"grad:{label}")
            got.append(start())
            if same:
                consume(got[-1])

    if caller:
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"caller-{label}") as pool:
            pool.submit(produce).result()
    else:
        produce()
    if not same:
        with cuda.stream(consumer):
            consume(got[0])
    grad, = cuda.find(f"grad:{label}", first)
    read, = cuda.find(f"read:{label}", first)
    launches = cuda.find("nccl:", first)
    assert launches, f"{label}: no NCCL call"
    for at in launches:
        stream = cuda.log[at][1]
        assert stream not in ("default", producer.name, consumer.name), (label, cuda.log[at])
        assert grad in cuda.deps(at), f"{label}: {cuda.log[at]} may run before the gradients are made"
    missing = set(launches) - cuda.deps(read)
    assert not missing, f"{label}: the result is read before {[cuda.log[i] for i in missing]}"
    for op, stream, what, _, thread in cuda.log[first:]:
        if op == "wait" and thread.startswith("fleetlike-"):
            assert stream not in ("default", producer.name, consumer.name), (label, op, stream, thread)


def test_fake_gradients_on_a_side_stream_through_every_path(fake):
    """Flat, hierarchical, compressed (flat and hierarchical), sharded and the DDP hook: each
    NCCL call after the kernels that made the gradients, the consumer after each NCCL call,
    helper threads waiting on their own streams only, and every helper NCCL call issued from
    the one issuer thread."""
    from fleetlike.collectives import CompressedAllReduce, FlatAllReduce, HalfCodec, HierarchicalAllReduce
    from fleetlike.collectives.sharded import ShardReduceScatter, plan_shards

    cuda = fake.cuda
    world = fake()
    pairs = [(world.split(0, name="intra"), world.split(1, name="inter"))]
    x = torch.ones(8)
    _through(cuda, "flat", lambda: world.all_reduce_async(x, "avg"))
    hier = HierarchicalAllReduce(pairs, world)
    _through(cuda, "hierarchical", lambda: hier.start_tensor(x, 0, "avg"))
    fp16 = CompressedAllReduce(FlatAllReduce([world]), HalfCodec("float16"))
    _through(cuda, "compressed", lambda: fp16.start_tensor(x, 0))
    fp16_hier = CompressedAllReduce(hier, HalfCodec("bfloat16"))
    _through(cuda, "compressed-hierarchical", lambda: fp16_hier.start_tensor(x, 0))
    buckets = plan_shards([torch.nn.Parameter(torch.ones(6))], None, 1)
    shard = ShardReduceScatter(0, [world], codec=HalfCodec("float16"))
    _through(cuda, "sharded", lambda: shard.start(buckets[0]))
    helper = {th for _, _, th in (cuda.log[i][1:3] + (cuda.log[i][4],) for i in cuda.find("nccl:"))}
    assert {t for t in helper if t != "MainThread"} == {"fleetlike-nccl_0"}, helper
    assert torch.equal(x, torch.ones(8))


def test_fake_ddp_hook_completes_its_future_after_nccl_on_a_helper_stream(fake, monkeypatch):
    """The DDP hook's finisher completes the future on its own stream, after the collective;
    the future names the bucket's device (``devices=``) so DDP's stream waits for it."""
    from fleetlike.comm import CommGroups
    from fleetlike.ddp import FleetHookState, fleetlike_hook

    cuda = fake.cuda
    made: list = []

    class Future(torch.futures.Future):
        """torch's CUDA future: ``set_result`` records an event on the setting thread's current
        stream, ``wait`` makes the waiting thread's current stream wait on it."""

        def __init__(self, devices=None):
            super().__init__()
            made.append(devices)
            self.mark = _FakeEvent()

        def set_result(self, value):
            cuda.kernel("ddp:set_result")
            self.mark.record()
            super().set_result(value)

        def wait(self):
            value = super().wait()
            cuda.current().wait_event(self.mark)
            return value

    monkeypatch.setattr(torch.futures, "Future", Future)
    world = fake()
    role = Role.from_endpoints(0, ["127.0.0.1:6170"])
    state = FleetHookState(groups=CommGroups(world, role), role=role)
    buf = torch.ones(5)
    bucket = types.SimpleNamespace(buffer=lambda: buf, index=lambda: 0, parameters=lambda: [buf], is_last=lambda: True)
    try:
        _through(cuda, "ddp", lambda: fleetlike_hook(state, bucket))
        done, = cuda.find("ddp:set_result")
        assert set(cuda.find("nccl:")) <= cuda.deps(done)
        assert cuda.log[done][1].startswith("s") and cuda.log[done][4].startswith("fleetlike-ddp")
        assert made == [None]  # a CPU bucket; a CUDA one passes devices=[its device]
    finally:
        state.close()


def test_fake_horovod_face_orders_side_stream_gradients_on_the_ranks_device(fake):
    """The Horovod face on an NCCL world of a rank on GPU 1: gradients made on a side stream by
    a thread of the caller's (as autograd's) go through ``hvd.allreduce_async_``, the
    out-of-place and grouped forms (``hvd.synchronize`` on another thread and stream), and the
    DistributedOptimizer's hooks (its ``synchronize`` and the read on the stream ``backward``
    ran on: the optimizer finishes its buckets in backward's final callback, which torch runs
    on the caller's streams, so a step on that stream reads them, as in torch). Each NCCL call
    after the gradients, the read after each NCCL call, and every CUDA call fleetlike makes
    with GPU 1 current."""
    import fleetlike.horovod as hvd
    from fleetlike import fleet

    cuda = fake.cuda
    world = fake(device="cuda:1")
    first = len(cuda.log)
    role = Role.from_endpoints(0, ["127.0.0.1:6170"])
    fleet.replace_world(role, world)  # the rank's tensors stay on the CPU: CUDA is the fake's
    hvd.init()
    try:
        x, big = torch.full((6,), 2.0), torch.arange(1 << 12, dtype=torch.float32)
        _through(cuda, "hvd-in-place", lambda: hvd.allreduce_async_(x, op=hvd.Sum), hvd.synchronize, caller=True)
        _through(cuda, "hvd-out", lambda: hvd.allreduce_async(big, name="big"), hvd.synchronize, caller=True)
        parts = [x.clone(), big[:5].clone()]
        _through(cuda, "hvd-grouped", lambda: hvd.grouped_allreduce_async_(parts, op=hvd.Sum), hvd.synchronize,
                 caller=True)
        model = torch.nn.Linear(4, 2)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        loss = model(torch.ones(3, 4)).square().sum()
        _through(cuda, "hvd-optimizer", lambda: (loss.backward(), opt)[1], lambda o: o.synchronize(), caller=True,
                 same=True)
        assert torch.equal(x, torch.full((6,), 2.0)) and torch.equal(parts[1], big[:5])  # a world of one
        opt.zero_grad()
    finally:
        hvd.shutdown()
        fleet.shutdown()
    ours = [e for e in cuda.log[first:] if e[0] != "set_device" and not e[2].startswith(("grad:", "read:"))]
    assert {e[4] for e in ours if e[0] == "record"} >= {"caller-hvd-in-place_0", "MainThread"}, ours
    wrong = [e for e in ours if e[3] != 1]
    assert not wrong, wrong[:5]


def test_fake_every_thread_uses_the_ranks_device(fake):
    """A rank on GPU 1: the training thread, the issuer, the finishers and the watchdog thread
    make every CUDA call with GPU 1 current (a call on GPU 0 would make a context there)."""
    from fleetlike.collectives import HierarchicalAllReduce
    from fleetlike.comm.watchdog import WATCHDOG

    cuda = fake.cuda
    world = fake(device="cuda:1")
    hier = HierarchicalAllReduce([(world.split(0), world.split(1))], world)
    hier.start_tensor(torch.ones(4), 0, "avg").wait()
    world.all_reduce(torch.ones(4))
    monkey_query = _FakeEvent.query
    seen = threading.Event()

    def query(self):
        if threading.current_thread().name == "fleetlike-watchdog":
            seen.set()
        return monkey_query(self)

    _FakeEvent.query = query
    try:
        _FakeEvent.query(_FakeEvent())  # a query from here counts as well
        world.timeout = 0.4  # the watchdog thread wakes every 0.1 s
        world.all_reduce_async(torch.ones(4))
        assert seen.wait(5), "the watchdog thread never polled the collective's event"
    finally:
        _FakeEvent.query = monkey_query
    # a thread of the caller's launching while the issuer has work queued: its stream position
    # is recorded for the issuer, with GPU 1 current there too
    from fleetlike.comm.cuda import ISSUER

    gate = threading.Event()
    queued = ISSUER.submit(lambda: gate.wait(5), world.stream_device)

    def release() -> None:  # once the caller's launch has queued behind the held job
        deadline = time.monotonic() + 5
        while ISSUER._queued < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        gate.set()

    threading.Thread(target=release, daemon=True).start()
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="caller") as pool:
        pool.submit(lambda: world.all_reduce(torch.ones(4))).result(10)
    queued.wait()
    threads = {th for *_, th in cuda.log}
    assert {"fleetlike-watchdog", "fleetlike-nccl_0", "MainThread", "caller_0"} <= threads, threads
    wrong = [entry for entry in cuda.log if entry[0] != "set_device" and entry[3] != 1]
    assert not wrong, wrong[:5]


def test_fake_nccl_async_error_ends_the_step_on_every_rank_with_its_reason(fake, monkeypatch, capsys):
    """A peer dies: each surviving rank's NCCL reports it through ncclCommGetAsyncError while
    the collective's kernel spins. The watchdog polls it and aborts every rank within seconds,
    with NCCL's reason, long before the (here 1800 s) deadline; CuPy 13's KeyError for
    ncclInProgress is no error."""
    exits: list[int] = []
    lock = threading.Lock()
    monkeypatch.setattr(nccl_watch, "exit_process", lambda code: (lock.acquire(), exits.append(code), lock.release()))
    store = dist.PrefixStore("nccl/world/", dist.HashStore())
    ranks = [fake(2, r, store=store) for r in range(2)]
    for comm in ranks:
        comm.timeout = 1800.0
    monkeypatch.setattr(_FakeEvent, "query", lambda self: False)  # the kernels never finish
    fake.nccl.errors = {0: KeyError(7), 1: KeyError(7)}  # ncclInProgress, as CuPy 13 raises it
    for comm in ranks:
        comm.all_reduce_async(torch.ones(3), agreed=True)
    time.sleep(1.5)
    assert exits == [], "ncclInProgress was taken for an error"
    t0 = time.monotonic()
    fake.nccl.errors = {r: (6, f"NCCL_ERROR_REMOTE_ERROR: remote process exited (seen by rank {r})") for r in range(2)}
    while len(exits) < 2 and time.monotonic() - t0 < 5:
        time.sleep(0.05)
    took = time.monotonic() - t0
    assert exits == [1, 1] and took < 5, (exits, took)
    err = capsys.readouterr().err
    for r in range(2):
        assert (f"NCCL reported an error on 'world' (nccl) on rank {r} (collective #1 all_reduce in flight): "
                f"NCCL_ERROR_REMOTE_ERROR: remote process exited (seen by rank {r})") in err, err
    assert fake.nccl.log.count("abort") == 2


def test_fake_init_is_watched(fake, monkeypatch, capsys):
    """ncclCommInitRank blocks until every rank arrives: a rank that never comes ends the
    process at the deadline, with the step named."""
    exits: list[int] = []
    release = threading.Event()
    monkeypatch.setattr(nccl_watch, "exit_process", lambda code: (exits.append(code), release.set()))
    cls = fake.nccl.NcclCommunicator

    class Stuck(cls):
        def __init__(self, *a):
            release.wait(10)
            super().__init__(*a)

    fake.nccl.NcclCommunicator = Stuck
    store = dist.PrefixStore("nccl/world/", dist.HashStore())
    comm = NcclCommunicator._connect(fake.nccl, store, 0, 1, range(1), "world", torch.device("cpu"), 0.3)
    assert exits == [1]
    assert "ncclCommInitRank on 'world' (nccl) has not finished after" in capsys.readouterr().err
    comm.close()


def test_fake_comm_streams_are_their_own(fake, monkeypatch):
    """A communicator's stream is made for it, never taken from torch's pool (which wraps)."""
    def pool(*a, **kw):
        raise AssertionError("a stream from torch's pool")

    monkeypatch.setattr(torch.cuda, "Stream", pool)
    a, b = fake(), fake()
    assert a.stream is not b.stream and a.stream.cuda_stream != b.stream.cuda_stream
    sub = a.split(0)
    assert sub.stream.cuda_stream not in (a.stream.cuda_stream, b.stream.cuda_stream)


def test_fake_size_check_costs_no_host_wait_and_a_mismatch_ends_the_job(fake, monkeypatch, capsys):
    """The default size check on NCCL: the rows are all-gathered on the comm stream and copied
    to the host there, nothing waits for them (no event synchronize, no host read on the
    calling thread); the watchdog compares them, and a peer with another element count ends
    the job with the ranks' table."""
    exits: list[int] = []
    fired = threading.Event()
    monkeypatch.setattr(nccl_watch, "exit_process", lambda code: (exits.append(code), fired.set()))
    syncs: list[str] = []
    monkeypatch.setattr(_FakeEvent, "synchronize", lambda self: syncs.append(threading.current_thread().name))
    comm = fake(2)
    x = torch.ones(3)
    comm.all_reduce(x)  # blocking form: the handle's wait orders the stream, no host sync
    assert fake.nccl.log[-2:] == ["allGather", "allReduce"] and not syncs
    assert torch.equal(x, torch.full((3,), 2.0))
    comm.all_reduce(x, agreed=True)
    assert fake.nccl.log[-2:] == ["allReduce", "allReduce"]
    deadline = time.monotonic() + 10  # the watchdog compares the agreeing rows within a poll period
    while comm._checks and time.monotonic() < deadline:
        time.sleep(0.02)
    assert exits == [] and not comm._checks
    fake.nccl.peer_numel = 1
    comm.all_reduce_async(torch.ones(5))
    assert fired.wait(5), "the watchdog never compared the size check's rows"
    err = capsys.readouterr().err
    assert "ranks of communicator 'world' (nccl) disagree on collective #3 all_reduce (found by the size check)" in err
    assert "(5,)" in err and exits == [1]


def test_fake_check_collectives_in_a_group_is_refused_clearly(fake):
    comm = fake(2)
    comm.check_collectives = True
    with pytest.raises(CommError, match=r"inside `with comm.group\(\):` with check_collectives on"):
        with comm.group():
            comm.all_reduce_async(torch.ones(3))
    comm.check_collectives = False
    with comm.group():  # without the check, a group takes the buckets as agreed
        work = comm.all_reduce_async(torch.ones(3))
    assert torch.equal(work.wait(), torch.full((3,), 2.0))


def test_fake_every_collective_dtype_op_goes_through_nccl_at_size_one(fake):
    comm = fake()
    assert fake.nccl.uids == [tuple(range(-64, 64))]  # the id came back intact from the store
    assert comm.native_avg and torch.bfloat16 in comm.native_reduce_dtypes
    cases = [c for kind in KINDS for dtype in DTYPES for c in _cases(kind, dtype)]
    check_all(cases, [run_cases(comm, cases)])
    # every non-empty case reached the binding: nothing was short-cut by the base class
    assert len(fake.nccl.log) == 2 * sum(1 for c in cases if 0 not in c.shape)
    comm.close()
    assert fake.nccl.log[-1] == "destroy"


@pytest.mark.parametrize("uid_type", [tuple, bytes], ids=["cupy<14-chars", "cupy>=14-bytes"])
def test_fake_either_cupy_form_of_the_unique_id_forms_the_communicator(fake, uid_type):
    fake.nccl.uid_type = uid_type  # the first GPU run (CuPy 14.2) failed here: it takes bytes
    comm = fake()
    assert fake.nccl.uids == [bytes(range(192, 256)) + bytes(range(64)) if uid_type is bytes
                              else tuple(range(-64, 64))]
    x = torch.arange(6, dtype=torch.float32)
    comm.all_reduce(x, op="sum")
    assert x.tolist() == list(range(6))
    comm.close()


def test_fake_group_defers_launch_and_integer_avg_division(fake):
    comm = fake(2)  # a mirrored peer: sums double, averages stay
    odd = torch.tensor([-3, -1, 1, 3, 5], dtype=torch.int64)
    with comm.group():
        w_int = comm.all_reduce_async(odd.clone(), op="avg")
        w_sum = comm.all_reduce_async(torch.ones(3), op="sum")
        assert fake.nccl.queued and not w_int.is_completed()
        with pytest.raises(CommError, match="after the block"):
            w_int.wait()
    assert torch.equal(w_int.wait(), odd)  # (2x) // 2, not 2 * (x // 2)
    assert torch.equal(w_sum.wait(), torch.full((3,), 2.0))
    assert torch.equal(comm.all_reduce(odd.clone(), op="avg"), odd)
    assert torch.equal(comm.all_reduce(torch.tensor([1.5, 2.5]), op="prod"), torch.tensor([2.25, 6.25]))


def test_fake_split_barrier_and_device_check(fake):
    comm = fake()
    assert comm.split(None) is None
    sub = comm.split(2, name="sub")
    assert isinstance(sub, NcclCommunicator) and (sub.name, sub.size, sub.ranks) == ("sub", 1, (0,))
    assert len(fake.nccl.uids) == 2
    sub.barrier()
    assert fake.nccl.log[-1] == "allReduce"
    with pytest.raises(ValueError, match="'nccl' communicator 'world' moves CUDA tensors on cpu"):
        comm.all_reduce(torch.ones(2, device="meta"))
    sub.close()
    comm.close()


def test_fake_close_gives_the_stream_back_without_destroying_it(fake, monkeypatch):
    """A closed communicator's stream goes back to the pool, where tensors freed later can
    still record on it and the next communicator reuses it."""
    import fleetlike.comm.cuda as cuda_mod

    owner = object()
    given: list = []
    monkeypatch.setattr(cuda_mod, "dedicated_stream", lambda device: (_FakeStream(fake.cuda), owner))
    monkeypatch.setattr(cuda_mod, "release_stream", lambda device, held: given.append(held))
    comm = fake()
    stream = comm.stream
    comm.close()
    comm.close()
    assert given == [(stream, owner)]


def test_fake_a_kernel_past_its_deadline_aborts_the_communicator_and_exits(fake, monkeypatch, capsys):
    """The watchdog polls each launched collective's event; one still running after the
    timeout is reported, its NCCL communicator aborted and the process ended (exit code 1)."""
    import threading

    from fleetlike.comm import nccl_watch as nccl_module
    from fleetlike.comm.watchdog import WATCHDOG

    exits: list[int] = []
    fired = threading.Event()
    monkeypatch.setattr(nccl_module, "exit_process", lambda code: (exits.append(code), fired.set()))
    comm = fake()
    comm.all_reduce(torch.ones(3))  # its event completes: the entry is dropped, nothing expires
    WATCHDOG.check()
    assert not any("(nccl)" in item.comm for item in WATCHDOG.in_flight())
    monkeypatch.setattr(_FakeEvent, "query", lambda self: False)  # the next kernel never finishes
    comm.timeout = 0.3
    comm.all_reduce_async(torch.ones(3))
    assert fired.wait(10), "the watchdog never expired the collective"
    assert exits == [1] and fake.nccl.log[-1] == "abort"
    err = capsys.readouterr().err
    assert "fleetlike: collective #2 all_reduce on 'world' (nccl) has not finished after" in err, err


def test_fake_an_abort_that_hangs_still_ends_the_process(fake, monkeypatch, capsys):
    """The first GPU run: ``ncclCommAbort`` did not return under a stuck kernel, and the process
    ran on. The watchdog gives the abort a grace period, then exits regardless."""
    import threading

    from fleetlike.comm import nccl_watch as nccl_module

    exits: list[int] = []
    fired, release = threading.Event(), threading.Event()
    monkeypatch.setattr(nccl_module, "exit_process", lambda code: (exits.append(code), fired.set()))
    monkeypatch.setattr(nccl_module, "ABORT_GRACE_S", 0.3)
    comm = fake()
    monkeypatch.setattr(comm._comm, "abort", lambda: release.wait(30), raising=False)
    monkeypatch.setattr(_FakeEvent, "query", lambda self: False)
    comm.timeout = 0.2
    comm.all_reduce_async(torch.ones(3))
    assert fired.wait(10), "the watchdog never ended the process"
    release.set()
    assert exits == [1]
    assert "ncclCommAbort on 'world' (nccl) did not return within 0.3s" in capsys.readouterr().err


# ------------------------------------------------------------------------- GPU

_REASON = nccl_unavailable_reason()
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(_REASON is not None, reason=f"no usable NCCL here: {_REASON}")


@pytest.fixture(scope="module")
def world():
    with _one_rank_role() as role:
        comm = create_world(role, backend="nccl", timeout=60)
        try:
            yield comm
        finally:
            comm.close()


def _cases(kind: str, dtype: str) -> list[Case]:
    ops = OPS if kind in ("all_reduce", "reduce", "reduce_scatter") else ("sum",)
    shapes = [(), (5,), (3, 7), (0,), (1000,)]
    return [
        Case(kind=kind, dtype=dtype, shape=shape, op=op, root=0, seed=seed, inplace=inplace, use_async=use_async)
        for seed, (op, shape, inplace, use_async) in enumerate(
            itertools.product(ops, shapes, (False, True), (False, True))
        )
    ]


@gpu
@needs_gpu
def test_world_is_nccl_on_this_gpu(world):
    assert isinstance(world, NcclCommunicator) and world.backend == "nccl"
    assert (world.rank, world.size, world.ranks) == (0, 1, (0,))
    assert world.device == torch.device("cuda", torch.cuda.current_device())
    assert world.nccl_version > 0
    print(f"NCCL {world.nccl_version} on {torch.cuda.get_device_name(world.device)}; "
          f"native_avg={world.native_avg}; native dtypes={sorted(map(str, world.native_reduce_dtypes))}")


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_every_collective_dtype_op_matches_numpy(world, kind, dtype):
    cases = _cases(kind, dtype)
    check_all(cases, [run_cases(world, cases, world.device)])


@gpu
@needs_gpu
@settings(max_examples=40)
@given(st.lists(case_strategy(1), min_size=1, max_size=8))
def test_collectives_match_numpy_hypothesis(world, cases):
    check_all(cases, [run_cases(world, cases, world.device)])


class _Counting:
    """Stands in for CuPy's NCCL communicator and counts the calls that reach it."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if callable(attr):
            def call(*args, **kw):
                self.calls.append(name)
                return attr(*args, **kw)
            return call
        return attr


@gpu
@needs_gpu
def test_a_world_of_one_really_calls_nccl(world):
    real = world._comm
    world._comm = counting = _Counting(real)
    try:
        x = torch.ones(8, device=world.device)
        world.all_reduce(x)
        world.broadcast(x)
        world.reduce(x)
        world.all_gather_flat(x)
        world.reduce_scatter(x)
        world.barrier()
    finally:
        world._comm = real
    assert counting.calls == ["allReduce", "broadcast", "reduce", "allGather", "reduceScatter", "allReduce"]


@gpu
@needs_gpu
def test_async_wait_orders_the_stream_without_blocking_the_host(world):
    x = torch.zeros(1 << 20, device=world.device)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on torch's current stream
    x.fill_(2.0)
    work = world.all_gather_flat_async(x)
    assert not work.is_completed(), "the collective finished before the sleeping kernel did"
    t0 = time.perf_counter()
    out = work.wait()
    waited = time.perf_counter() - t0
    assert waited < 0.05, f"wait() blocked the host for {waited:.3f}s"
    assert not world.stream.query(), "the comm stream was idle while its input was still made"
    assert torch.equal(out.cpu(), torch.full((1 << 20,), 2.0))  # ordered after the collective
    torch.cuda.synchronize()
    assert work.is_completed() and world.stream.query()


@gpu
@needs_gpu
@pytest.mark.parametrize("kind", ["all_gather_flat", "reduce_scatter", "all_reduce_out", "broadcast_out"])
def test_input_made_just_before_the_call_is_seen_without_sync(world, kind):
    n = 1 << 22
    side = torch.cuda.Stream(device=world.device)
    with torch.cuda.stream(side):  # a non-default current stream: the comm must wait on it
        x = torch.zeros(n, device=world.device)
        torch.cuda._sleep(100_000_000)
        x.fill_(3.0)
        if kind == "all_gather_flat":
            out = world.all_gather_flat(x)
        elif kind == "reduce_scatter":
            out = world.reduce_scatter(x, out=torch.empty_like(x))
        elif kind == "all_reduce_out":
            out = world.all_reduce(x, out=torch.empty_like(x))
        else:
            out = world.broadcast(x, out=torch.empty_like(x))
        got = out.cpu()  # on the side stream, after wait()
    assert torch.equal(got, torch.full((n,), 3.0))


@gpu
@needs_gpu
def test_ordering_test_is_sensitive(world):
    """Control: raw NCCL on the comm stream, without the wait, reads the stale input."""
    nccl = nccl_setup.require_nccl()
    n = 1 << 22
    x = torch.zeros(n, device=world.device)
    out = torch.full((n,), -1.0, device=world.device)
    h = world.stream.cuda_stream
    world.nccl_comm.allGather(x.data_ptr(), out.data_ptr(), n, nccl.NCCL_FLOAT32, h)  # warm-up
    torch.cuda.synchronize()
    out.fill_(-1.0)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    x.fill_(3.0)
    world.nccl_comm.allGather(x.data_ptr(), out.data_ptr(), n, nccl.NCCL_FLOAT32, h)
    world.stream.synchronize()
    stale = out.cpu()
    torch.cuda.synchronize()
    assert torch.equal(stale, torch.zeros(n)), "NCCL waited anyway: the ordering tests prove nothing"


@gpu
@needs_gpu
@pytest.mark.parametrize("path", ["flat", "hierarchical", "compressed", "compressed-hierarchical", "sharded"])
def test_side_stream_gradients_through_helper_paths(world, path):
    """The probe of stream ordering across threads: gradients made late on a side stream (a
    0.1 s spin, then the fill) go through each path, and a third stream reads the result right
    after ``wait()``. A helper thread that launched on its own default stream, or a handle
    that ordered the wrong stream, reads the zeros (the ordering control below shows that an
    unordered read does)."""
    from fleetlike.collectives import CompressedAllReduce, FlatAllReduce, HalfCodec, HierarchicalAllReduce
    from fleetlike.collectives.sharded import ShardReduceScatter, plan_shards

    dev, n = world.device, 1 << 20
    pairs = [(world.split(0, name="intra"), world.split(1, name="inter"))]
    try:
        hier = HierarchicalAllReduce(pairs, world)
        producer, consumer = torch.cuda.Stream(device=dev), torch.cuda.Stream(device=dev)
        param = torch.nn.Parameter(torch.zeros(n, device=dev))
        bucket = plan_shards([param], None, 1)[0]
        x = bucket.buffer if path == "sharded" else torch.zeros(n, device=dev)
        starts = {
            "flat": lambda: world.all_reduce_async(x, "avg"),
            "hierarchical": lambda: hier.start_tensor(x, 0, "avg"),
            "compressed": lambda: CompressedAllReduce(FlatAllReduce([world]), HalfCodec("float16")).start_tensor(x, 0),
            "compressed-hierarchical": lambda: CompressedAllReduce(hier, HalfCodec("bfloat16")).start_tensor(x, 0),
            "sharded": lambda: ShardReduceScatter(0, [world], codec=HalfCodec("float16")).start(bucket),
        }
        torch.cuda.synchronize()
        with torch.cuda.stream(producer):
            x.zero_()
            torch.cuda._sleep(200_000_000)
            x.fill_(3.0)
            work = starts[path]()
        with torch.cuda.stream(consumer):
            work.wait()
            got = x.clone()
        torch.cuda.synchronize()
        assert torch.equal(got.cpu(), torch.full((n,), 3.0)), f"{path}: read {got[:4].tolist()} before the result"
    finally:
        for a, b in pairs:
            a.close()
            b.close()


@gpu
@needs_gpu
def test_comm_streams_are_not_torch_pool_streams(world):
    """More than 32 pool streams later, no communicator shares torch's stream pool."""
    pool = {torch.cuda.Stream(device=world.device).cuda_stream for _ in range(40)}
    subs = [world.split(0) for _ in range(3)]
    try:
        mine = {world.stream.cuda_stream} | {s.stream.cuda_stream for s in subs}
        assert len(mine) == 4 and not mine & pool
    finally:
        for s in subs:
            s.close()


@gpu
@needs_gpu
def test_out_of_place_leaves_the_input(world):
    x = torch.arange(10, dtype=torch.float32, device=world.device)
    out = torch.empty_like(x)
    assert world.all_reduce(x, "max", out=out) is out
    assert torch.equal(x.cpu(), torch.arange(10, dtype=torch.float32))
    assert torch.equal(out.cpu(), torch.arange(10, dtype=torch.float32))


@gpu
@needs_gpu
def test_group_launches_several_buckets(world):
    dev = world.device
    buckets = [torch.full((n,), float(i + 1), device=dev) for i, n in enumerate([1, 1000, 1 << 20])]
    ints = torch.arange(-7, 8, dtype=torch.int64, device=dev)
    halves = torch.full((33,), 0.5, dtype=torch.bfloat16, device=dev)
    with world.group():
        works = [world.all_reduce_async(b, op="avg") for b in buckets]
        works.append(world.all_reduce_async(ints, op="avg"))  # sum + floor division, deferred
        works.append(world.all_reduce_async(halves, op="sum"))
        works.append(world.all_gather_flat_async(torch.full((1000,), 2.0, device=dev)))
        works.append(world.reduce_scatter_async(buckets[2].clone(), op="max"))
        assert not any(w.is_completed() for w in works)
    results = [w.wait() for w in works]
    for i, b in enumerate(buckets):
        assert torch.equal(results[i].cpu(), torch.full((b.numel(),), float(i + 1)))
    assert torch.equal(results[3].cpu(), torch.arange(-7, 8))
    assert torch.equal(results[4].cpu(), torch.full((33,), 0.5, dtype=torch.bfloat16))
    assert torch.equal(results[5].cpu(), torch.full((1000,), 2.0))
    assert torch.equal(results[6].cpu(), torch.full((1 << 20,), 3.0))


@gpu
@needs_gpu
def test_group_nests_and_spans_communicators(world):
    sub = world.split(0)
    try:
        a = torch.ones(4, device=world.device)
        b = torch.full((4,), 2.0, device=world.device)
        with world.group():
            wa = world.all_reduce_async(a)
            with sub.group():
                wb = sub.all_reduce_async(b)
            assert not wb.is_completed()  # launched only when the outermost block ends
        assert torch.equal(wa.wait().cpu(), torch.ones(4))
        assert torch.equal(wb.wait().cpu(), torch.full((4,), 2.0))
    finally:
        sub.close()


@gpu
@needs_gpu
def test_wait_inside_a_group_says_to_wait_after_it(world):
    with world.group():
        work = world.all_reduce_async(torch.ones(4, device=world.device))
        with pytest.raises(CommError, match="after the block"):
            work.wait()
    assert torch.equal(work.wait().cpu(), torch.ones(4))


@gpu
@needs_gpu
def test_split_by_color(world):
    assert world.split(None) is None
    sub = world.split(3, name="mine")
    try:
        assert isinstance(sub, NcclCommunicator)
        assert (sub.name, sub.rank, sub.size, sub.ranks) == ("mine", 0, 1, (0,))
        assert sub.stream.cuda_stream != world.stream.cuda_stream
        assert sub.all_reduce(torch.tensor([5], device=world.device)).item() == 5
        subsub = sub.split(0)
        assert subsub.all_gather_flat(torch.tensor([7], device=world.device)).tolist() == [7]
        subsub.close()
    finally:
        sub.close()
    with pytest.raises(CommError, match="closed"):
        sub.all_reduce(torch.ones(1, device=world.device))


@gpu
@needs_gpu
def test_cpu_tensor_on_nccl_is_refused(world):
    with pytest.raises(ValueError, match=r"is on cpu, but the 'nccl' communicator .* moves CUDA tensors"):
        world.all_reduce(torch.ones(3))
    with pytest.raises(ValueError, match="gloo"):
        world.broadcast(torch.ones(3), out=torch.ones(3, device=world.device))


@gpu
@needs_gpu
def test_barrier_and_stats(world):
    world.stats.reset()
    world.barrier()
    world.all_reduce(torch.zeros(1000, device=world.device))
    assert world.stats.calls == {"all_reduce": 1}
    assert world.stats.bytes == {"all_reduce": 4000}


def _per_call(fn, n: int) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


@gpu
@needs_gpu
def test_overhead_against_raw_cupy_nccl(world):
    """Per-call time of fleetlike's all_reduce and of the raw CuPy call (world of one: overhead
    only, not bandwidth). Writes JSON to $FLEETLIKE_NCCL_BENCH when set."""
    nccl = nccl_setup.require_nccl()
    comm = world.nccl_comm
    rows = []
    for nbytes, calls in ((8, 2000), (64 << 20, 200)):
        n = nbytes // 4
        x = torch.ones(n, device=world.device)
        y = torch.empty_like(x)
        p, q, h = x.data_ptr(), y.data_ptr(), torch.cuda.current_stream().cuda_stream
        f32, add = nccl.NCCL_FLOAT32, nccl.NCCL_SUM

        def raw_in(p=p, n=n):
            comm.allReduce(p, p, n, f32, add, h)

        def raw_out(p=p, q=q, n=n):
            comm.allReduce(p, q, n, f32, add, h)

        for mode, ours, raw in (
            ("in-place", lambda x=x: world.all_reduce(x), raw_in),
            ("out-of-place", lambda x=x, y=y: world.all_reduce(x, out=y), raw_out),
        ):
            t_ours, t_raw = _per_call(ours, calls), _per_call(raw, calls)
            rows.append({"bytes": nbytes, "mode": mode, "calls": calls, "fleetlike_us": t_ours * 1e6,
                         "raw_cupy_us": t_raw * 1e6, "ratio": t_ours / t_raw})
    for r in rows:
        print(f"{r['bytes']:>10} B {r['mode']:>12}: fleetlike {r['fleetlike_us']:8.1f} us, "
              f"raw cupy {r['raw_cupy_us']:8.1f} us, x{r['ratio']:.2f}")
    path = os.environ.get("FLEETLIKE_NCCL_BENCH")
    if path:
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(world.device), "torch": torch.__version__,
                       "nccl": world.nccl_version, "rows": rows}, f, indent=1)
    assert all(r["fleetlike_us"] > 0 for r in rows)


_STUCK = """
import sys, time, torch
from fleetlike.comm import create_world
from fleetlike.testing import hosted_job
with hosted_job(1, 1, job_id="nccl-watchdog") as job:
    comm = create_world(job.role(0), backend="nccl", timeout=60)
    comm.all_reduce(torch.ones(4, device=comm.device))
    torch.cuda.synchronize()
    comm.timeout = 2.0
    torch.cuda._sleep(int(4e11))  # minutes of GPU spin on torch's stream: the next kernel waits
    comm.all_reduce_async(torch.ones(4, device=comm.device))
    print("launched", flush=True)
    time.sleep(90)
    print("never aborted", flush=True)
"""


@gpu
@needs_gpu
@pytest.mark.timeout(150)
def test_a_collective_stuck_on_the_gpu_aborts_the_communicator_and_ends_the_process():
    """The watchdog on a real GPU: its thread polls the launch's CUDA event, and a collective
    queued behind a kernel that outlives the timeout gets the report, `ncclCommAbort` and exit 1
    (what the fake-NCCL test checks with a fake event)."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _STUCK], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    took = time.monotonic() - t0
    assert "launched" in proc.stdout and "never aborted" not in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert "all_reduce on 'world' (nccl) has not finished after" in proc.stderr, proc.stderr[-2000:]
    assert took < 60, took  # 2 s timeout + at most 10 s for ncclCommAbort + start-up

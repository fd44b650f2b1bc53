"""Which device and backend each face picks, checked on the CPU with torch.cuda's answers
patched (the GPU runs of tests/test_gpu_faces.py check the same choices on a real GPU).

The first GPU run found: a one-GPU job's `single` world refused CUDA tensors; a DDP
hook on CUDA buckets met its job on gloo (which refuses them); a job started by torchrun, MPI or
Slurm on a GPU machine trained on the CPU unless CUDA_VISIBLE_DEVICES was set.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from fleetlike.comm import SingleCommunicator
from fleetlike.ddp import FleetHookState
from fleetlike.fleet import facade
from fleetlike.horovod.collectives import comm_device
from fleetlike.roles import Role
from fleetlike.roles.settings import EnvSettings


def _role(source: str, gpus: tuple[int, ...] = ()) -> Role:
    """Rank 1 of two on one node (local rank 1), as ``source`` would start it."""
    base = Role.from_endpoints(1, ["127.0.0.1:6170", "127.0.0.1:6171"])
    return dataclasses.replace(base, source=source, selected_gpus=gpus)


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


@pytest.mark.parametrize("source,gpus,env,backend,want", [
    ("paddle", (1,), {}, None, "cuda:1"),            # fleetlike.launch --selected_gpus
    ("paddle", (), {}, None, "cpu"),                 # fleetlike.launch --nproc_per_node on CPU
    ("paddle", (), {"cuda_visible_devices": "0,1"}, None, "cuda:1"),
    ("paddle", (), {}, "nccl", "cuda:1"),            # asked for NCCL: a GPU
    ("torchrun", (), {}, None, "cuda:1"),            # local rank 1 of a DDP/Horovod script
    ("openmpi", (), {}, None, "cuda:1"),
    ("slurm", (), {}, None, "cuda:1"),
    ("single", (), {}, None, "cuda:1"),
    ("user", (), {}, None, "cpu"),                   # a Role built by hand (tests, UserDefinedRoleMaker)
    ("user", (), {"cuda_visible_devices": "1"}, None, "cuda:1"),
    ("torchrun", (), {}, "gloo", "cpu"),             # a CPU backend keeps CPU tensors
    ("torchrun", (), {"backend": "mpi"}, None, "cpu"),
])
def test_device_for_each_launcher(two_gpus, source, gpus, env, backend, want):
    got = facade._device_for(_role(source, gpus), EnvSettings(**env), backend)
    assert str(got) == want


def test_device_for_without_a_usable_gpu_is_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # CUDA_VISIBLE_DEVICES=""
    assert str(facade._device_for(_role("torchrun"), EnvSettings())) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert str(facade._device_for(_role("paddle", gpus=(0,)), EnvSettings())) == "cpu"


def test_the_single_world_takes_tensors_of_any_device():
    """A one-GPU job's world is `single`: nothing moves, so CUDA tensors stay (meta stands in)."""
    comm = SingleCommunicator()
    x = torch.empty(4, device="meta")
    assert comm.all_reduce(x, "avg") is x
    assert comm.broadcast(x, 0) is x
    assert comm.all_gather_flat(x).device.type == "meta"
    assert comm.reduce_scatter(torch.empty(4, device="meta")).device.type == "meta"
    assert comm.all_reduce(torch.arange(3.0), "sum").tolist() == [0.0, 1.0, 2.0]


def test_ddp_hook_meets_its_job_on_the_buckets_device(monkeypatch):
    import fleetlike.ddp.state as ddp_state

    seen = []

    def create_world(role, *, backend="auto", timeout=0, device=None):
        seen.append((backend, device))
        return SingleCommunicator("world", 0)

    monkeypatch.setattr(ddp_state, "create_world", create_world)
    monkeypatch.setenv("FLEETLIKE_BACKEND", "nccl")
    role = Role.from_endpoints(0, ["127.0.0.1:6170"])
    state = FleetHookState(role=role)
    state.ensure_connected(torch.device("cuda", 0))
    state.ensure_connected(torch.device("cuda", 0))  # once
    assert seen == [("nccl", torch.device("cuda", 0))]
    assert state.role is role  # the role given to the state, not the environment's
    state.close()


@pytest.mark.parametrize("backend,tensor_dev,want", [
    ("nccl", "cpu", "cuda:0"),     # hvd.allreduce(torch.tensor(loss)) in a GPU job: staged
    ("nccl", "cuda:0", "cuda:0"),
    ("gloo", "cuda:0", "cpu"),     # a CUDA tensor in a CPU job: staged through the host
    ("gloo", "cpu", "cpu"),
    ("single", "cpu", "cpu"),      # a world of one moves nothing: no staging
])
def test_horovod_stages_a_tensor_on_the_other_device(backend, tensor_dev, want):
    rt = SimpleNamespace(device=torch.device("cuda:0" if backend != "gloo" else "cpu"),
                         comm=SimpleNamespace(backend=backend))
    t = SimpleNamespace(device=torch.device(tensor_dev))
    assert str(comm_device(rt, t)) == want


def test_fleet_and_nccl_agree_on_each_local_ranks_gpu(two_gpus, monkeypatch):
    """``--selected_gpus=0,1``: local rank 1 trains on GPU 1 in fleet and in the NCCL
    communicator (fleet took the first id on every rank: two ranks on GPU 0, "Duplicate GPU"
    at NCCL init), and fleet.init makes it the rank's current device."""
    from fleetlike import fleet
    from fleetlike.comm import cuda
    from fleetlike.comm.nccl_setup import resolve_device

    for gpus, want in (((0, 1), 1), ((1, 0), 0), ((1,), 1)):
        role = _role("paddle", gpus)
        assert facade._device_for(role, EnvSettings()) == resolve_device(role, None) == torch.device("cuda", want)
    third = Role.from_endpoints(2, ["127.0.0.1:6170", "127.0.0.1:6171", "127.0.0.1:6172"], selected_gpus=[0, 1])
    with pytest.raises(ValueError, match="has no entry for local rank 2"):
        facade._device_for(third, EnvSettings())
    made: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", made.append)
    monkeypatch.setattr(cuda, "_THREAD", __import__("threading").local())
    monkeypatch.setattr(facade, "create_world", lambda role, **kw: SingleCommunicator("world", 0))
    fleet.init(_role("paddle", (0, 1)))
    try:
        assert fleet.device() == torch.device("cuda", 1) and made == [1]
    finally:
        fleet.shutdown()


def test_gpu_extras_name_the_packages_cupy_finds_nccl_with():
    """``fleetlike[gpu]``: CuPy finds the nvidia-nccl-cu12 wheel's library only from 13.5;
    ``fleetlike[gpu-cu13]``: the CUDA 13 packages (cupy-cuda13x starts at 13.6)."""
    import configparser
    from pathlib import Path

    from packaging.requirements import Requirement

    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).resolve().parents[1] / "setup.cfg")
    extras = cfg["options.extras_require"]

    def reqs(name):
        return {r.name: r.specifier for r in map(Requirement, filter(None, extras[name].split("\n")))}

    gpu, cu13 = reqs("gpu"), reqs("gpu-cu13")
    assert set(gpu) == {"cupy-cuda12x", "nvidia-nccl-cu12"} and set(cu13) == {"cupy-cuda13x", "nvidia-nccl-cu13"}
    assert not gpu["cupy-cuda12x"].contains("13.4.1") and gpu["cupy-cuda12x"].contains("13.5.1")
    assert cu13["cupy-cuda13x"].contains("13.6.0") and cu13["cupy-cuda13x"].contains("14.2.0")


class _FakeCupyStream:
    """CuPy's stream as far as `dedicated_stream` uses it; counts the ones destroyed."""

    made = 0
    destroyed = 0

    def __init__(self, non_blocking: bool) -> None:
        type(self).made += 1
        self.ptr = 0x1000 + type(self).made

    def __del__(self) -> None:
        type(self).destroyed += 1


@pytest.fixture
def fake_cupy(monkeypatch):
    import contextlib
    import sys

    from fleetlike.comm import cuda

    _FakeCupyStream.made = _FakeCupyStream.destroyed = 0
    fake = SimpleNamespace(cuda=SimpleNamespace(Device=lambda i: contextlib.nullcontext(), Stream=_FakeCupyStream))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda ptr, device: SimpleNamespace(cuda_stream=ptr))
    monkeypatch.setattr(cuda, "_KEPT", [])
    monkeypatch.setattr(cuda, "_SPARE", {})
    return cuda


def test_comm_streams_outlive_their_users_and_are_reused(fake_cupy):
    """A tensor ``record_stream``-ed on a communicator's stream may be freed after the
    communicator is gone; the allocator then records an event on that stream, which aborts the
    process when the stream was destroyed (the GPU run's "invalid device context" after the
    hierarchical side-stream probe). No stream is ever destroyed; one given back is reused."""
    import gc
    import threading

    cuda, dev = fake_cupy, torch.device("cuda", 0)
    first, second = cuda.dedicated_stream(dev), cuda.dedicated_stream(dev)
    assert _FakeCupyStream.made == 2 and first[0].cuda_stream != second[0].cuda_stream
    cuda.release_stream(dev, first)
    del first, second
    gc.collect()
    assert _FakeCupyStream.destroyed == 0
    again = cuda.dedicated_stream(dev)
    assert _FakeCupyStream.made == 2, "a released stream is handed out again"
    assert cuda.dedicated_stream(torch.device("cuda", 1))[0].cuda_stream != again[0].cuda_stream
    cuda.release_stream(dev, (object(), None))  # not one of ours (no owner): not pooled
    assert cuda._SPARE.get(0, []) == []

    seen: list = []
    worker = threading.Thread(target=lambda: seen.append(cuda._helper_stream(dev)))
    worker.start()
    worker.join()
    del worker
    gc.collect()
    assert _FakeCupyStream.destroyed == 0
    assert cuda.dedicated_stream(dev)[0] is seen[0], "an ended helper thread's stream is reused"

"""Every face of the library on a GPU: CUDA models, CUDA gradient buckets, NCCL streams.

One GPU means a world of one, so the arithmetic across ranks is the gloo/MPI tests' job; here
each face trains (or moves) the same thing on ``cuda:0`` and on the CPU and the two must agree,
on a world built on NCCL (``backend='nccl'``: every collective really reaches NCCL at size
one) and on the default world (``single``, which must take CUDA tensors). The first GPU run
found three faults this file now guards: CuPy 14's bytes unique id, the `single`
world refusing CUDA tensors, Horovod calls on CPU tensors in an NCCL job.

Skipped, with the reason, without a CUDA device + CuPy + NCCL (CI has none; see docs/gpu.md).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch

from fleetlike import DistributedStrategy, Executor, fleet
from fleetlike.comm.nccl_setup import nccl_unavailable_reason
from fleetlike.testing import run_ranks

_REASON = nccl_unavailable_reason()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(_REASON is not None, reason=f"no usable NCCL here: {_REASON}")]

IN, HID, OUT, BATCH, STEPS = 12, 16, 3, 8, 6

STRATEGIES: dict[str, dict] = {
    "data_parallel": {},
    "localsgd": {"localsgd": True, "localsgd_configs": {"k_steps": 2, "begin_step": 1}},
    "adaptive_localsgd": {"adaptive_localsgd": True, "adaptive_localsgd_configs": {"init_k_steps": 2,
                                                                                    "begin_step": 2}},
    "gradient_merge": {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2, "avg": True}},
    "amp_bf16": {"amp": True, "amp_configs": {"dtype": "bfloat16"}},
    "amp_fp16": {"amp": True, "amp_configs": {"dtype": "float16", "init_loss_scaling": 1024.0,
                                              "incr_every_n_steps": 2}},
    "recompute": {"recompute": True, "recompute_configs": {"checkpoints": ["body"]}},
    "sync_batch_norm": {"sync_batch_norm": True},
    "fp16_allreduce": {"fp16_allreduce": True},
    "bf16_allreduce": {"fp16_allreduce": True, "fp16_allreduce_configs": {"dtype": "bfloat16"}},
    "nccl_comm_num": {"nccl_comm_num": 2, "fuse_grad_size_in_MB": 0.0005},
    "sharding": {"sharding": True, "sharding_configs": {"sharding_degree": 0}},
    "merge+amp_fp16": {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2},
                       "amp": True, "amp_configs": {"dtype": "float16", "init_loss_scaling": 1024.0}},
}
#: CUDA and CPU kernels round differently; half precision rounds differently again
TOL = {"amp_bf16": 3e-2, "amp_fp16": 5e-3, "merge+amp_fp16": 5e-3, "fp16_allreduce": 2e-3,
       "bf16_allreduce": 2e-2}


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.body = torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.BatchNorm1d(HID), torch.nn.Tanh())
        self.head = torch.nn.Linear(HID, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def batch(step: int, device: torch.device) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(step * 7919)
    return {"x": torch.from_numpy(rng.standard_normal((BATCH, IN)).astype("float32")).to(device),
            "y": torch.from_numpy(rng.integers(0, OUT, BATCH)).to(device)}


def loss_fn(model: torch.nn.Module, feed: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(feed["x"]).float(), feed["y"])


def state(model: torch.nn.Module) -> list[np.ndarray]:
    return [t.detach().double().cpu().numpy().copy() for t in model.state_dict().values()]


def max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def _device_env(device: str, backend: str | None) -> None:
    """What a rank sees: the GPU selected (or none), and the forced backend (or auto)."""
    os.environ.pop("FLEETLIKE_BACKEND", None)
    if backend:
        os.environ["FLEETLIKE_BACKEND"] = backend
    if device == "cuda":  # the rank's role is built by hand (run_ranks): it needs a GPU named
        os.environ["CUDA_VISIBLE_DEVICES"] = "0"
    else:  # before CUDA is initialised in this fresh rank: torch sees no GPU
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def _faces(role: Any, name: str, device: str, backend: str | None) -> dict[str, Any]:
    """The program style and the eager loop, one after the other, on ``device``."""
    _device_env(device, backend)
    out: dict[str, Any] = {}
    strategy = DistributedStrategy.from_dict(STRATEGIES[name])
    fleet.init(role, timeout=60, backend="nccl" if backend == "nccl" else None)
    try:
        dev = fleet.device()
        out["device"], out["backend"] = str(dev), fleet.context().world.backend
        model = Net().to(dev)
        opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.2), strategy)
        opt.minimize(loss_fn, model)
        exe = Executor(dev)
        exe.run(fleet.startup_program)
        out["program_losses"] = [float(exe.run(fleet.main_program, feed=batch(s, dev), fetch_list=["loss"])[0])
                                 for s in range(STEPS)]
        out["program"] = state(model)
    finally:
        fleet.shutdown()
    fleet.init(role, timeout=60, backend="nccl" if backend == "nccl" else None)
    try:
        dev = fleet.device()
        model = fleet.distributed_model(Net().to(dev))
        opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.2), strategy)
        for s in range(STEPS):
            opt.zero_grad()
            loss = loss_fn(model, batch(s, dev))
            loss.backward()
            opt.step(loss=loss)
        out["eager"] = state(model.module)
        out["applied"] = [str(a) for a in fleet.applied_strategy()]
    finally:
        fleet.shutdown()
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_program_and_eager_faces_on_cuda_match_the_cpu(name):
    cpu = run_ranks(_faces, 1, name, "cpu", None, timeout=120)[0]
    assert cpu["device"] == "cpu"
    tol = TOL.get(name, 2e-5)
    for backend in ("nccl", None):
        gpu = run_ranks(_faces, 1, name, "cuda", backend, timeout=240)[0]
        assert gpu["device"] == "cuda:0" and gpu["backend"] == (backend or "single"), gpu["device"]
        assert gpu["applied"] == cpu["applied"], (name, backend)
        assert max_diff(gpu["program"], cpu["program"]) <= tol, (name, backend, max_diff(gpu["program"], cpu["program"]))
        assert max_diff(gpu["eager"], cpu["eager"]) <= tol, (name, backend, max_diff(gpu["eager"], cpu["eager"]))
        np.testing.assert_allclose(gpu["program_losses"], cpu["program_losses"], atol=max(tol, 1e-5) * 10)


# ------------------------------------------------------------------------------ Horovod


def _hvd(role: Any, device: str) -> dict[str, Any]:
    """Every Horovod call once on ``device`` tensors in an NCCL job (CPU tensors are staged),
    then the DistributedOptimizer on a CUDA model (plain, fp16, two passes per step, GradScaler)."""
    import fleetlike.horovod as hvd

    _device_env("cuda", "nccl")
    hvd.init(role_maker=role, timeout=60.0)
    dev = torch.device(device)
    out: dict[str, Any] = {"backend": fleet.context().world.backend}
    try:
        g = torch.Generator().manual_seed(5)
        x = torch.randn(3, 4, generator=g).to(dev)
        xi = torch.randint(1, 9, (5,), generator=g, dtype=torch.int32).to(dev)
        res: dict[str, Any] = {}
        for op in ("average", "sum", "min", "max", "product"):
            res[f"ar.{op}"] = hvd.allreduce(x, op=op)
            y = x.clone()
            hvd.allreduce_(y, op=op, name=f"inplace.{op}")
            res[f"ar_.{op}"] = y
            res[f"ar_async.{op}"] = hvd.synchronize(hvd.allreduce_async(x, op=op))
        res["ar.int.sum"] = hvd.allreduce(xi, op=hvd.Sum)
        res["ar.scaled"] = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
        res["ar.fp16"] = hvd.allreduce(x, compression=hvd.Compression.fp16)
        res["ar.big"] = hvd.allreduce(torch.arange(1 << 20, dtype=torch.float32).to(dev), op=hvd.Sum)
        res["grouped"] = hvd.grouped_allreduce([x, x[0]], op=hvd.Sum)
        gi = [x.clone(), x[1].clone()]
        hvd.grouped_allreduce_(gi)
        res["grouped_"] = gi
        res["gather"] = hvd.allgather(x)
        b = x.clone()
        hvd.broadcast_(b, 0)
        res["bcast"] = (hvd.broadcast(x, 0), b)
        res["a2a"], received = hvd.alltoall(x, splits=[3])
        out["a2a_received"] = received.tolist()
        res["rs"] = hvd.reducescatter(x, op=hvd.Sum)
        res["adasum"] = hvd.allreduce(x.double(), op=hvd.Adasum)
        w = x.clone().requires_grad_(True)
        (hvd.allreduce(w, op=hvd.Sum) * 2).sum().backward()
        res["grad"] = w.grad
        hvd.barrier()
        out["devices"] = sorted({str(t.device) for v in res.values()
                                 for t in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(t, torch.Tensor)})
        out["res"] = {k: ([t.detach().cpu().numpy() for t in v] if isinstance(v, (list, tuple))
                          else v.detach().cpu().numpy()) for k, v in res.items()}
        out["obj"] = (hvd.broadcast_object({"a": 1}, 0), hvd.allgather_object(("r", 0)))
        # training on the GPU
        out["train"] = {}
        for case in ("plain", "fp16", "bpps2", "scaler"):
            model = Net().cuda()
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                           named_parameters=model.named_parameters(),
                                           compression=hvd.Compression.fp16 if case == "fp16" else hvd.Compression.none,
                                           backward_passes_per_step=2 if case == "bpps2" else 1)
            hvd.broadcast_optimizer_state(opt, root_rank=0)
            scaler = torch.amp.GradScaler("cuda", init_scale=1024.0) if case == "scaler" else None
            for s in range(STEPS):
                opt.zero_grad()
                for micro in range(2 if case == "bpps2" else 1):
                    loss = loss_fn(model, batch(10 * s + micro, torch.device("cuda")))
                    (scaler.scale(loss) if scaler else loss).backward()
                if scaler:
                    opt.synchronize()
                    scaler.unscale_(opt)
                    with opt.skip_synchronize():
                        scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
            out["train"][case] = state(model)
    finally:
        hvd.shutdown()
    return out


def _hvd_reference(case: str) -> list[np.ndarray]:
    """Plain torch on the GPU: at one rank the Horovod optimizer is the optimizer (with
    ``backward_passes_per_step`` the passes' gradients add up, as in Horovod)."""
    model = Net().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for s in range(STEPS):
        opt.zero_grad()
        for micro in range(2 if case == "bpps2" else 1):
            loss_fn(model, batch(10 * s + micro, torch.device("cuda"))).backward()
        opt.step()
    return state(model)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_horovod_face_on_nccl_with_cuda_and_cpu_tensors(device):
    """CUDA tensors go to NCCL as they are; CPU tensors (``hvd.allreduce(torch.tensor(loss))``,
    as Horovod's own MNIST example does) are staged through the GPU and come back on the CPU."""
    got = run_ranks(_hvd, 1, device, timeout=240)[0]
    assert got["backend"] == "nccl"
    want_dev = "cuda:0" if device == "cuda" else "cpu"
    assert got["devices"] == [want_dev]
    r = got["res"]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, generator=g).numpy()
    xi = torch.randint(1, 9, (5,), generator=g, dtype=torch.int32).numpy()
    for op in ("average", "sum", "min", "max", "product"):  # a world of one: every op is the identity
        for k in ("ar", "ar_", "ar_async"):
            np.testing.assert_allclose(r[f"{k}.{op}"], x, rtol=1e-6, err_msg=f"{k}.{op}")
    np.testing.assert_array_equal(r["ar.int.sum"], xi)
    np.testing.assert_allclose(r["ar.scaled"], x * 1.5, rtol=1e-6)
    np.testing.assert_allclose(r["ar.fp16"], x, atol=2e-3)
    np.testing.assert_array_equal(r["ar.big"], np.arange(1 << 20, dtype=np.float32))
    np.testing.assert_allclose(r["grouped"][0], x, rtol=1e-6)
    np.testing.assert_allclose(r["grouped"][1], x[0], rtol=1e-6)
    np.testing.assert_allclose(r["grouped_"][1], x[1], rtol=1e-6)
    np.testing.assert_allclose(r["gather"], x, rtol=1e-6)
    np.testing.assert_allclose(r["bcast"][0], x, rtol=1e-6)
    np.testing.assert_allclose(r["bcast"][1], x, rtol=1e-6)
    np.testing.assert_allclose(r["a2a"], x, rtol=1e-6)
    assert got["a2a_received"] == [3]
    np.testing.assert_allclose(r["rs"], x, rtol=1e-6)
    np.testing.assert_allclose(r["adasum"], x, rtol=1e-6)
    np.testing.assert_allclose(r["grad"], np.full_like(x, 2.0))
    assert got["obj"] == ({"a": 1}, [("r", 0)])
    for case, params in got["train"].items():
        ref = _hvd_reference(case)
        tol = 2e-3 if case == "fp16" else 1e-5
        assert max_diff(params, ref) <= tol, (case, max_diff(params, ref))


# ------------------------------------------------------------------------------ DDP


def _ddp(role: Any, backend: str | None, hier_fp16: bool) -> list[np.ndarray]:
    """torch's DDP on a CUDA model with fleetlike's hook (its own world: NCCL or single)."""
    import torch.distributed as dist

    from fleetlike.ddp import register

    _device_env("cuda", backend)
    rendezvous = f"/tmp/fleetlike-gpu-ddp-{os.getpid()}"
    dist.init_process_group("nccl", init_method=f"file://{rendezvous}", rank=0, world_size=1)
    try:
        model = torch.nn.parallel.DistributedDataParallel(Net().cuda(), device_ids=[0], bucket_cap_mb=0.0005)
        strategy = DistributedStrategy(fp16_allreduce=hier_fp16, nccl_comm_num=2)
        hook = register(model, strategy, role=role)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for s in range(STEPS):
            opt.zero_grad()
            loss_fn(model, batch(s, torch.device("cuda"))).backward()
            opt.step()
        world = hook.groups.world if hook.groups is not None else None
        assert world is not None and world.backend == (backend or "single"), world
        hook.close()
        return state(model.module)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["nccl", None])
@pytest.mark.parametrize("fp16", [False, True])
def test_ddp_hook_on_cuda_buckets(backend, fp16):
    got = run_ranks(_ddp, 1, backend, fp16, timeout=240)[0]
    model = Net().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(STEPS):
        opt.zero_grad()
        loss_fn(model, batch(s, torch.device("cuda"))).backward()
        opt.step()
    assert max_diff(got, state(model)) <= (2e-3 if fp16 else 1e-5)


# ------------------------------------------------------------------------------ side streams


SPIN = 50_000_000  # cycles of GPU spin before each backward: an unordered collective reads stale buckets


def _cpu_sgd(momentum: float) -> list[np.ndarray]:
    """The reference: plain torch SGD on the CPU (a world of one averages nothing)."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    for s in range(STEPS):
        opt.zero_grad()
        loss_fn(model, batch(s, torch.device("cpu"))).backward()
        opt.step()
    return state(model)


def _train_on(stream: Any, model: torch.nn.Module, opt: torch.optim.Optimizer, dev: torch.device) -> None:
    """STEPS steps with ``stream`` current, each backward queued behind a GPU spin."""
    with torch.cuda.stream(stream):
        for s in range(STEPS):
            opt.zero_grad()
            torch.cuda._sleep(SPIN)
            loss_fn(model, batch(s, dev)).backward()
            opt.step()
    torch.cuda.synchronize()


def _side_streams(role: Any, backend: str = "nccl") -> dict[str, Any]:
    """Training and reductions issued on a non-default stream, each after a GPU spin, through
    the DDP hook (flat, fp16 on helper threads, two communicators) and the Horovod face (its
    DistributedOptimizer, and ``allreduce_async_`` / ``allreduce_async`` / grouped started on a
    helper thread of the caller's and synchronized on a third stream), all on one NCCL world
    (``backend='gloo'``: the same calls on the CPU, with the stream calls as no-ops, for a dry
    run of this function where no GPU is)."""
    import threading

    import torch.distributed as dist

    import fleetlike.horovod as hvd
    from fleetlike.ddp import register

    _device_env("cuda" if backend == "nccl" else "cpu", backend)
    fleet.init(role, timeout=60, backend=backend)
    dev = fleet.device()
    side = torch.cuda.Stream(device=dev)
    out: dict[str, Any] = {"backend": fleet.context().world.backend, "device": str(dev)}
    dist.init_process_group(backend, init_method=f"file:///tmp/fleetlike-gpu-side-{os.getpid()}", rank=0, world_size=1)
    try:
        for name, strategy in (("ddp", DistributedStrategy()),
                               ("ddp-fp16", DistributedStrategy(fp16_allreduce=True)),
                               ("ddp-2comms", DistributedStrategy(nccl_comm_num=2))):
            model = torch.nn.parallel.DistributedDataParallel(Net().to(dev), bucket_cap_mb=0.0005,
                                                              device_ids=[dev.index] if dev.type == "cuda" else None)
            hook = register(model, strategy, groups=fleet.context().groups, role=role)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            _train_on(side, model, opt, dev)
            out[name] = state(model.module)
            hook.close()
        hvd.init()
        try:
            model = Net().to(dev)
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                           named_parameters=model.named_parameters())
            _train_on(side, model, opt, dev)
            out["hvd-optimizer"] = state(model)
            n = 1 << 20
            x, y, z = (torch.zeros(n, device=dev) for _ in range(3))
            producer, consumer = torch.cuda.Stream(device=dev), torch.cuda.Stream(device=dev)
            handles: list[Any] = []

            def produce() -> None:  # a thread of the caller's: its current stream is the producer
                with torch.cuda.stream(producer):
                    torch.cuda._sleep(4 * SPIN)
                    x.fill_(3.0)
                    y.fill_(5.0)
                    z.fill_(7.0)
                    handles.append(hvd.allreduce_async_(x, op=hvd.Sum, name="side.in_place"))
                    handles.append(hvd.allreduce_async(x, op=hvd.Sum, name="side.copy"))
                    handles.append(hvd.grouped_allreduce_async_([y, z], op=hvd.Sum, name="side.grouped"))

            torch.cuda.synchronize()
            worker = threading.Thread(target=produce)
            worker.start()
            worker.join()
            with torch.cuda.stream(consumer):
                got = [hvd.synchronize(h) for h in handles]
                read = [x.clone(), got[1].clone(), y.clone(), z.clone()]
            torch.cuda.synchronize()
            out["hvd-async"] = [float(t.min()) for t in read] + [float(t.max()) for t in read]
        finally:
            hvd.shutdown()
    finally:
        dist.destroy_process_group()
        fleet.shutdown()
    return out


@pytest.mark.timeout(300)
def test_side_stream_gradients_through_ddp_and_horovod_match_the_cpu():
    """The GPU half of the fake NCCL's side-stream checks for the DDP and Horovod faces: one
    rank process runs every variant; each must equal plain torch on the CPU."""
    got = run_ranks(_side_streams, 1, timeout=240)[0]
    assert got["backend"] == "nccl" and got["device"] == "cuda:0"
    plain = _cpu_sgd(0.0)
    for name, tol in (("ddp", 2e-5), ("ddp-fp16", 2e-3), ("ddp-2comms", 2e-5)):
        assert max_diff(got[name], plain) <= tol, (name, max_diff(got[name], plain))
    momentum = _cpu_sgd(0.9)
    assert max_diff(got["hvd-optimizer"], momentum) <= 2e-5, max_diff(got["hvd-optimizer"], momentum)
    assert got["hvd-async"] == [3.0, 3.0, 5.0, 7.0] * 2, got["hvd-async"]

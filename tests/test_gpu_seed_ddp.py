"""The seed pages' DDP start and Light's FusedOptimizer on a machine with CUDA.

There `fleetlike.init_process_group()` (and Light's ``pytorch_ddp``) forms torch's group with
``cpu:gloo,cuda:nccl``: a DDP model on ``cuda:0`` must train as the same model without DDP (a
world of one), a job of two CPU ranks must still equal plain DDP, and ``FusedOptimizer`` must run
torch's fused CUDA kernels and equal the unfused optimizer.

Skipped, with the reason, without a CUDA device (CI has none; see docs/gpu.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fleetlike
from fleetlike.calc import FusedOptimizer

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")]


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).cuda()


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer | FusedOptimizer) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    for _ in range(4):
        x, y = torch.randn(8, 12, generator=g).cuda(), torch.randn(8, 3, generator=g).cuda()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


def test_light_pytorch_ddp_on_cuda_forms_gloo_and_nccl_and_trains_as_the_plain_model() -> None:
    import torch.distributed as dist

    @fleetlike.light_init(params={"training_framework": "pytorch_ddp"})
    def main() -> tuple[str, list[torch.Tensor], bool]:
        model = torch.nn.parallel.DistributedDataParallel(_net(), device_ids=[0])
        got = _steps(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        t = torch.ones(2, device="cuda")
        dist.all_reduce(t)  # NCCL for CUDA tensors
        c = torch.ones(2)
        dist.all_reduce(c)  # gloo for CPU tensors
        return str(dist.get_backend()), got, bool(model._comm_hooks)

    backend, got, hooked = main()
    plain = _net()
    want = _steps(plain, torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9))
    assert "nccl" in backend and "gloo" in backend, backend
    assert hooked
    assert max(float((a - b).abs().max()) for a, b in zip(got, want)) <= 1e-6


def test_fused_optimizer_runs_the_fused_cuda_kernel() -> None:
    plain = _net()
    want = _steps(plain, torch.optim.AdamW(plain.parameters(), lr=0.01))
    model = _net()
    opt = FusedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    assert opt.kernel == "fused"
    got = _steps(model, opt)
    assert max(float((a - b).abs().max()) for a, b in zip(got, want)) <= 1e-6


def test_the_init_line_with_two_cpu_ranks_on_a_cuda_machine_equals_plain_ddp(tmp_path: Path) -> None:
    from examples_common import clean_env, launcher
    from helpers import run_job

    seed = Path(__file__).resolve().parent / "launch_workers" / "seed_ddp.py"
    said = {}
    for name in ("plain", "tiacc"):
        cmd = launcher(str(seed), str(tmp_path), name, name, log_dir=tmp_path / f"{name}.log")
        done = run_job(cmd, cwd=tmp_path, env=clean_env(), timeout=200)
        said[name] = done.stdout
        assert done.returncode == 0, done.stdout
    assert "backend cpu:gloo,cuda:nccl" in said["tiacc"], said["tiacc"]
    for r in range(2):
        a, b = torch.load(tmp_path / f"plain.{r}.pt"), torch.load(tmp_path / f"tiacc.{r}.pt")
        assert max(float((x - y).abs().max()) for x, y in zip(a, b)) <= 1e-6

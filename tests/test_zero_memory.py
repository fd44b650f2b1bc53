"""Memory of ZeRO stage 3, measured per rank: the peak RSS of training steps above the rank's own
baseline after ``fleet.init`` (glibc's mmap threshold fixed at 128 KiB, so freed blocks go back
to the system; the kernel's high-water mark reset after the first step, since the model is still
built whole before it is sharded), each trainer alone in its own 2-rank world, for data
parallel, stage 1, stage 3 and torch's FSDP2 (measured: 21.2, 17.2, 15.0 and 15.3 bytes per
parameter); and the bytes of the tensors a stage 3 rank holds
between steps (16/N per fp32 AdamW parameter: every parameter's shard, gradient shard and Adam
moments)."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from fleetlike import DistributedStrategy, fleet
from fleetlike.testing import run_ranks

LAYERS, WIDTH = 6, 1024


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def _held(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    def own(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = sum(own(p) + (own(p.grad) if p.grad is not None else 0) for p in model.parameters())
    return params + sum(own(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim())


def _rss(field: str) -> int:
    """``VmRSS`` or ``VmHWM`` (the peak since the last reset) of this process, in bytes."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _peak(role, kind: str) -> tuple[float, int]:
    ctypes.CDLL("libc.so.6").mallopt(-3, 131072)  # M_MMAP_THRESHOLD
    from torch.distributed.fsdp import fully_shard

    from fleetlike.comm.torch_group import torch_process_group

    with fleet.session(role, timeout=120):
        if kind == "fsdp2":
            torch_process_group(fleet.context().world, fleet.device())
        base = _rss("VmRSS")
        model = _model()
        if kind == "fsdp2":
            for layer in model:
                fully_shard(layer)
            fully_shard(model)
            wrapped, opt = model, torch.optim.AdamW(model.parameters(), lr=1e-4)
        else:
            opts = {} if kind == "dp" else {"sharding": True,
                                            "sharding_configs": {"sharding_degree": 0, "stage": int(kind[5])}}
            wrapped = fleet.distributed_model(model)
            opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4),
                                              DistributedStrategy.from_dict(opts))
        x = torch.randn(8, WIDTH)
        for step in range(4):
            if step == 1:  # the model is built and sharded, the optimizer state exists
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # reset the peak RSS (VmHWM)
            opt.zero_grad(set_to_none=False)
            F.mse_loss(wrapped(x), x).backward()
            opt.step()
        held = _held(model, opt)
        peak = _rss("VmHWM")
        del wrapped, model, opt
    return float(peak - base), held


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stage3_peak_memory_below_data_parallel_and_at_most_fsdp2():
    n = LAYERS * (WIDTH * WIDTH + WIDTH)
    runs = {kind: run_ranks(_peak, 2, kind, timeout=120) for kind in ("dp", "stage1", "stage3", "fsdp2")}
    worst = {k: max(r[0] for r in v) / n for k, v in runs.items()}
    assert worst["stage3"] < worst["stage1"] < worst["dp"], worst
    assert worst["stage3"] <= 1.1 * worst["fsdp2"], worst
    # data parallel holds at least its 16 bytes per parameter; stage 3 and FSDP2 both read about
    # 15 on the CPU (16/2 of shards, plus about one full copy of the weights in flight)
    assert worst["dp"] >= 16 and worst["stage3"] < 0.8 * worst["dp"], worst
    for _, tensors in runs["stage3"]:  # between steps: exactly a half of parameters, gradients and moments
        assert tensors == 16 * n // 2

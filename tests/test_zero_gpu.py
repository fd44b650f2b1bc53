"""Sharding on a GPU (a world of one, on NCCL). Stage 3 with ``sharding_configs.optimize_offload``
and ``offload_params`` (EPL's ``offload.level: "v0"``) keeps the parameter shards and the
optimizer state in host memory and runs the update there, and trains to the parameters the
same run without offload reaches (within CUDA-vs-CPU rounding). Every value the ranks agree on
travels on the communicator's GPU: the same-model check, the global gradient norm
(``clip_norm``), the finite check (``check_nan_inf``), the checkpoint's agreement and tag; a
stage 3 checkpoint written on the GPU resumes exactly; stage 1 with clipping trains as stage 3.

Skipped, with the reason, without a CUDA device + NCCL (CI has none; see docs/gpu.md)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from fleetlike import DistributedStrategy, fleet
from fleetlike.comm.nccl_setup import nccl_unavailable_reason
from fleetlike.testing import run_ranks
from zero_common import STEPS, TinyLM, batch, loss_fn, make_opt, rel_diff, state

_REASON = nccl_unavailable_reason()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(_REASON is not None, reason=f"no usable NCCL here: {_REASON}")]

_CHECKS = {"check_nan_inf": True}
_STAGE = {1: {"sharding": True, "sharding_configs": {"sharding_degree": 0, "stage": 1, "clip_norm": 0.5,
                                 "clip_after_allreduce": True}, **_CHECKS},
          3: {"sharding": True, "sharding_configs": {"sharding_degree": 0, "stage": 3, "clip_norm": 0.5,
                                 "clip_after_allreduce": True}, **_CHECKS}}
_OFFLOAD = {"offload.level": "v0", "check_nan_inf": True}


def _train(opts: dict, start: int, load: str | None = None, save: str | None = None) -> dict[str, Any]:
    dev = fleet.device()
    model = fleet.distributed_model(TinyLM().to(dev))
    opt = fleet.distributed_optimizer(make_opt("momentum", model.parameters()), DistributedStrategy.from_dict(opts))
    if load:
        fleet.load_persistables(None, load)
    for step in range(start, STEPS):
        feed = {k: v.to(dev) for k, v in batch(step, 0, 1).items()}
        opt.zero_grad()
        loss_fn(model, feed).backward()
        opt.step()
        if save and step == STEPS // 2 - 1:
            fleet.save_persistables(None, save)
    return {"device": str(dev), "state": state({k: v.cpu() for k, v in fleet.full_state_dict(model).items()}),
            "param_devices": sorted({getattr(p, "to_local", lambda: p)().device.type for p in model.parameters()}),
            "state_devices": sorted({v.to_local().device.type for s in opt.state.values() for v in s.values()
                                     if hasattr(v, "to_local")}),
            "applied": [str(a) for a in model.engine.applied]}


def _run(role: Any, opts: dict, save: str | None, resume: bool) -> dict[str, Any]:
    os.environ["CUDA_VISIBLE_DEVICES"] = "0"  # the rank's role is built by hand: it needs a GPU named
    with fleet.session(role, timeout=60, backend="nccl"):
        out = _train(opts, 0, save=save)
    if resume:
        with fleet.session(role, timeout=60, backend="nccl"):
            out["resumed"] = _train(opts, STEPS // 2, load=save)["state"]
    return out


@pytest.mark.timeout(240)
def test_stage3_offload_keeps_shards_in_host_memory_and_trains_the_same(tmp_path):
    plain = run_ranks(_run, 1, _STAGE[3], str(tmp_path / "ckpt"), True, timeout=200)[0]
    off = run_ranks(_run, 1, _OFFLOAD, None, False, timeout=150)[0]
    one = run_ranks(_run, 1, _STAGE[1], None, False, timeout=150)[0]
    assert plain["device"].startswith("cuda") and plain["param_devices"] == ["cuda"]
    assert any(a.startswith("sharding: applied") for a in plain["applied"]), plain["applied"]
    assert rel_diff(plain["resumed"], plain["state"]) <= 1e-6  # the checkpoint written on the GPU resumes
    assert off["param_devices"] == ["cpu"] and off["state_devices"] == ["cpu"]
    assert any(a.startswith("sharding_configs.optimize_offload: applied") for a in off["applied"]), off["applied"]
    unclipped = run_ranks(_run, 1, {k: v for k, v in _STAGE[3].items()} | {
        "sharding_configs": {"sharding_degree": 0, "stage": 3}}, None, False, timeout=150)[0]
    assert rel_diff(off["state"], unclipped["state"]) <= 1e-4
    assert rel_diff(one["state"], plain["state"]) <= 1e-4  # stage 1 clips the same global norm
    assert rel_diff(plain["state"], unclipped["state"]) > 1e-4  # and the clip acted


_WIDTH, _LAYERS = 2048, 8


def _peak(role: Any, offload: bool) -> dict[str, float]:
    os.environ["CUDA_VISIBLE_DEVICES"] = "0"
    opts: dict = {"sharding": True, "sharding_configs": {"sharding_degree": 0, "stage": 3,
                                                         "optimize_offload": offload}}
    with fleet.session(role, timeout=60, backend="nccl"):
        dev = fleet.device()
        base = torch.cuda.memory_allocated(dev)
        torch.manual_seed(0)
        model = fleet.distributed_model(torch.nn.Sequential(*(torch.nn.Linear(_WIDTH, _WIDTH)
                                                              for _ in range(_LAYERS))).to(dev))
        opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4),
                                          DistributedStrategy.from_dict(opts))
        x = torch.randn(16, _WIDTH, device=dev)
        for step in range(3):
            if step == 1:  # the model was built whole on the GPU: measure the steps after sharding
                torch.cuda.reset_peak_memory_stats(dev)
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        torch.cuda.synchronize(dev)
        params = sum(p.numel() for p in model.parameters())
        return {"peak": float(torch.cuda.max_memory_allocated(dev) - base), "params": float(params)}


@pytest.mark.timeout(180)
def test_offload_keeps_the_state_off_the_gpu_measured():
    """The saving offload is for, measured: 8 x Linear(2048) (33.6M parameters, AdamW) at stage 3
    holds its parameters, gradients and optimizer state (16 B/param) on the GPU; with offload the
    GPU holds only the block being gathered and the activations."""
    plain = run_ranks(_peak, 1, False, timeout=150)[0]
    off = run_ranks(_peak, 1, True, timeout=150)[0]
    n = plain["params"]
    print(f"\nstage 3 GPU peak: {plain['peak'] / n:.2f} B/param without offload, "
          f"{off['peak'] / n:.2f} B/param with offload ({n / 1e6:.1f}M parameters)")
    assert plain["peak"] >= 16 * n  # parameters, gradients and AdamW's two moments, all on the GPU
    assert off["peak"] < 4 * n      # a block or two at full size and the activations, no state

"""Offload at stage 3 on a GPU (a world of one, on NCCL): with ``sharding_configs.optimize_offload``
and ``offload_params`` (EPL's ``offload.level: "v0"``) the parameter shards and the optimizer
state live in host memory and the update runs there, and training gives the parameters the
same run without offload gives (within CUDA-vs-CPU rounding).

Skipped, with the reason, without a CUDA device + NCCL (CI has none; see docs/gpu.md)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from fleetlike import DistributedStrategy, fleet
from fleetlike.comm.nccl import nccl_unavailable_reason
from fleetlike.testing import run_ranks
from zero_common import STEPS, TinyLM, batch, loss_fn, make_opt, rel_diff, state

_REASON = nccl_unavailable_reason()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(_REASON is not None, reason=f"no usable NCCL here: {_REASON}")]


def _run(role: Any, offload: bool) -> dict[str, Any]:
    os.environ["CUDA_VISIBLE_DEVICES"] = "0"  # the rank's role is built by hand: it needs a GPU named
    opts: dict = {"sharding": True, "sharding_configs": {"sharding_degree": 0, "stage": 3}}
    if offload:
        opts = {"offload.level": "v0"}
    with fleet.session(role, timeout=60, backend="nccl"):
        dev = fleet.device()
        model = fleet.distributed_model(TinyLM().to(dev))
        opt = fleet.distributed_optimizer(make_opt("adamw", model.parameters()), DistributedStrategy.from_dict(opts))
        for step in range(STEPS):
            feed = {k: v.to(dev) for k, v in batch(step, 0, 1).items()}
            opt.zero_grad()
            loss_fn(model, feed).backward()
            opt.step()
        return {"device": str(dev), "state": state({k: v.cpu() for k, v in fleet.full_state_dict(model).items()}),
                "param_devices": sorted({p.to_local().device.type for p in model.parameters()}),
                "state_devices": sorted({v.to_local().device.type for s in opt.state.values() for v in s.values()
                                         if hasattr(v, "to_local")}),
                "applied": [str(a) for a in model.engine.applied]}


@pytest.mark.timeout(180)
def test_stage3_offload_keeps_shards_in_host_memory_and_trains_the_same():
    plain = run_ranks(_run, 1, False, timeout=150)[0]
    off = run_ranks(_run, 1, True, timeout=150)[0]
    assert plain["device"].startswith("cuda") and plain["param_devices"] == ["cuda"]
    assert off["param_devices"] == ["cpu"] and off["state_devices"] == ["cpu"]
    assert any(a.startswith("sharding_configs.optimize_offload: applied") for a in off["applied"]), off["applied"]
    assert rel_diff(off["state"], plain["state"]) <= 1e-4

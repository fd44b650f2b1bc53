"""AIACC's accumulate, perf-check and downsample variables act in the Horovod face on 2 ranks:
``PERSEUS_ACCUMULATE_N_STEPS=2`` trains as torch DDP with ``no_sync`` over 2 passes (Horovod's
``backward_passes_per_step=2``), ``PERSEUS_DOWNSAMPLE_N_ELEMENTS=2`` as gossip computed by hand
in numpy, ``FLEETLIKE_PERF_CHECK_N_STEPS=2`` gathers both ranks' step times every 2 steps and
leaves the parameters as a plain run's."""

from __future__ import annotations

import os
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dp_common import torch_group
from helpers import labelled_batch, max_diff, params
import fleetlike.horovod as hvd
from fleetlike.testing import run_ranks

STEPS, PASSES, N = 4, 2, 2


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Linear(6, 3, bias=False)  # one parameter: gossip's one bucket is its gradient


def _feed(step: int, micro: int, rank: int) -> dict[str, torch.Tensor]:
    return labelled_batch(1000 * step + 10 * micro + rank, 4, 6, 3)


def _loss(model, feed):
    return F.cross_entropy(model(feed["x"]), feed["y"])


def _hvd(role, environ, passes, micro=1, **kwargs):
    """One Horovod loop under ``environ``: ``micro`` backward passes per ``step()``."""
    with mock.patch.dict(os.environ, environ):
        model = _model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                       named_parameters=model.named_parameters(), backward_passes_per_step=passes,
                                       **kwargs)
        reports = []
        for step in range(STEPS):
            for m in range(micro):
                _loss(model, _feed(step, m, role.rank)).backward()
            opt.step()
            opt.zero_grad()
            reports.append(getattr(opt, "slow_rank_report", None))
        applied = [str(e) for e in opt.applied_strategy()] if hasattr(opt, "reducer") else []
    return params(model), applied, reports


def _runs(role, rendezvous):
    hvd.init(role_maker=role, timeout=60)
    try:
        out = {
            "accumulate": _hvd(role, {"PERSEUS_ACCUMULATE_N_STEPS": str(PASSES)}, 1, PASSES),
            "passes": _hvd(role, {}, PASSES, PASSES),
            "gossip": _hvd(role, {"PERSEUS_DOWNSAMPLE_N_ELEMENTS": str(N)}, 1),
            "perf": _hvd(role, {"FLEETLIKE_PERF_CHECK_N_STEPS": "2"}, 1),
            "plain": _hvd(role, {}, 1),
            "adasum_acc": _hvd(role, {"PERSEUS_ACCUMULATE_N_STEPS": str(PASSES)}, 1, PASSES, op=hvd.Adasum),
            "adasum_passes": _hvd(role, {}, PASSES, PASSES, op=hvd.Adasum),
        }
        try:
            _hvd(role, {"PERSEUS_ACCUMULATE_N_STEPS": "2"}, 3, 3)
        except ValueError as err:
            out["conflict"] = str(err)
        try:
            _hvd(role, {"PERSEUS_DOWNSAMPLE_N_ELEMENTS": "2"}, 1, op=hvd.Adasum)
        except ValueError as err:
            out["adasum_gossip"] = str(err)
    finally:
        hvd.shutdown()
    with torch_group(role, rendezvous):  # DDP's no_sync: PASSES passes summed, averaged over ranks
        ddp = torch.nn.parallel.DistributedDataParallel(_model())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
        for step in range(STEPS):
            for m in range(PASSES):
                if m < PASSES - 1:
                    with ddp.no_sync():
                        _loss(ddp, _feed(step, m, role.rank)).backward()
                else:
                    _loss(ddp, _feed(step, m, role.rank)).backward()
            opt.step()
            opt.zero_grad()
        out["ddp"] = params(ddp.module)
    return out


def _gossip_by_hand() -> np.ndarray:
    """Both ranks in one process: each step's gradient plus the rank's residual, the elements
    ``step % N, step % N + N, ...`` of it averaged, the rest kept as the residual."""
    model = _model()
    residual = [np.zeros(model.weight.numel()) for _ in range(2)]
    for step in range(STEPS):
        grads = []
        for rank in range(2):
            model.zero_grad()
            _loss(model, _feed(step, 0, rank)).backward()
            grads.append(model.weight.grad.detach().numpy().ravel().astype(np.float64) + residual[rank])
        where = np.arange(step % N, grads[0].size, N)
        update = np.zeros(grads[0].size)
        update[where] = (grads[0][where] + grads[1][where]) / 2
        for rank in range(2):
            residual[rank] = grads[rank].copy()
            residual[rank][where] = 0.0
        with torch.no_grad():
            model.weight -= 0.5 * torch.from_numpy(update.reshape(model.weight.shape)).float()
    return model.weight.detach().numpy()


@pytest.mark.timeout(150)
def test_accumulate_perf_check_and_downsample_act_in_the_horovod_face(tmp_path):
    results = run_ranks(_runs, 2, str(tmp_path / "rdv"), timeout=130)
    by_hand = _gossip_by_hand()
    for rank, out in enumerate(results):
        assert max_diff(out["accumulate"][0], out["ddp"]) <= 1e-6, rank
        assert max_diff(out["accumulate"][0], out["passes"][0]) <= 1e-6, rank
        assert any("the sum of 2 backward passes" in a for a in out["accumulate"][1]), out["accumulate"][1]
        assert max_diff(out["gossip"][0], [by_hand]) <= 1e-6, rank
        assert max_diff(out["gossip"][0], out["plain"][0]) > 1e-4, rank  # gossip acted
        assert any(a.startswith("gossip: applied") for a in out["gossip"][1]), out["gossip"][1]
        assert max_diff(out["perf"][0], out["plain"][0]) <= 1e-6, rank
        assert any(a.startswith("slow_rank_check: applied") for a in out["perf"][1]), out["perf"][1]
        reports = out["perf"][2]
        assert reports[0] is None and reports[1] is not None and len(reports[1].step_times) == 2, reports
        assert reports[3] is not reports[1] and all(r is None for r in out["plain"][2])
        assert max_diff(out["adasum_acc"][0], out["adasum_passes"][0]) <= 1e-6, rank
        assert max_diff(out["adasum_acc"][0], out["accumulate"][0]) > 1e-6, rank  # Adasum is not the average
        assert "no gradient buckets to down-sample" in out["adasum_gossip"]
        assert "backward_passes_per_step=3" in out["conflict"] and "PERSEUS_ACCUMULATE_N_STEPS" in out["conflict"]

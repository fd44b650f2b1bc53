"""AIACC's ``PERSEUS_*`` and TI-ACC's ``TIACC_*`` / ``LIGHT_*`` variables (seeds 004, 001): each acts
with its documented meaning or is refused with the reason; they act in every face (Fleet eager and
program, Horovod, DDP) through one path; TI-ACC's ``MixedPrecision_TrainingPolicy`` takes both of
its documented calls."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import fleetlike
import fleetlike.horovod as hvd
from dp_common import batch, loss_fn, make_model, torch_group
from helpers import max_diff, params
from fleetlike import Executor, fleet
from fleetlike.config import DistributedStrategy
from fleetlike.config.knobs import VENDOR_KNOBS, KnobError, knob_options, vendor_names
from fleetlike.ddp.knobs import strategy_from_env
from fleetlike.roles.settings import strategy_with_env
from fleetlike.testing import run_ranks

SEEDS = Path("/work/shared/seeds")


def _page_names() -> set[str]:
    names: set[str] = set()
    for path in SEEDS.glob("00[0-4]_*.txt"):
        names |= set(re.findall(r"((?:PERSEUS|TIACC|LIGHT)_[A-Z0-9_]+)", path.read_text(encoding="utf-8")))
    return names - {"TIACC_T"}  # a line break inside TIACC_TRAINING_FUSION_THRESHOLD's row


#: a documented value of each variable -> what the strategy shows, or the words of its refusal
ACTS = {
    "PERSEUS_ALLREDUCE_NANHECK": ("1", lambda s: s.check_nan_inf),
    "PERSEUS_ALLREDUCE_DTYPE": ("2", lambda s: s.fp16_allreduce and str(s.fp16_allreduce_configs["mode"]) == "mixed"
                                and s.fp16_allreduce_configs["grad_scale"] == 10.0),
    "PERSEUS_ALLREDUCE_MODE": ("1", lambda s: s.use_hierarchical_allreduce),
    # the page's line: PERSEUS_ALLREDUCE_DTYPE=2 PERSEUS_ALLREDUCE_GRADIENT_SCALE=5 perseusrun
    "PERSEUS_ALLREDUCE_GRADIENT_SCALE": ({"PERSEUS_ALLREDUCE_DTYPE": "2", "PERSEUS_ALLREDUCE_GRADIENT_SCALE": "5"},
                                         lambda s: s.fp16_allreduce_configs["grad_scale"] == 5.0),
    "PERSEUS_ALLREDUCE_STREAMS": ("8", lambda s: s.nccl_comm_num == 8),
    "PERSEUS_ALLREDUCE_FUSION": ("16", lambda s: s.fuse_grad_max_buckets == 16),
    "PERSEUS_ACCUMULATE_N_STEPS": ("4", lambda s: s.gradient_merge and s.gradient_merge_configs["k_steps"] == 4),
    "PERSEUS_DOWNSAMPLE_N_ELEMENTS": ("4", lambda s: s.gossip and s.gossip_configs["downsample_n_elements"] == 4),
    "PERSEUS_GRADIENT_MOMENTUM": ("1", lambda s: s == DistributedStrategy()),
    "PERSEUS_NCCL_ENABLE": ("0", lambda s: s == DistributedStrategy()),
    "PERSEUS_OFFLINE_NEG": ("0", lambda s: s == DistributedStrategy()),
    "PERSEUS_PERF_CHECK_N_STEPS": ("100", lambda s: s.slow_rank_check
                                   and s.slow_rank_check_configs["every_n_steps"] == 100),
    "PERSEUS_CHANGE_HVD_ALLGATHER": ("1", lambda s: s == DistributedStrategy()),
    "PERSEUS_USE_DDP_LAUNCHER": ("0", lambda s: s == DistributedStrategy()),
    "LIGHT_2D_ALLREDUCE": ("1", lambda s: s.use_hierarchical_allreduce),
    "TIACC_TRAINING_FUSION_THRESHOLD": ("25217728", lambda s: s.bucket_cap_bytes() == 25217728),
    "TIACC_TRAINING_NUM_NCCL_STREAMS": ("3", lambda s: s.nccl_comm_num == 3),
}
REFUSED = {
    "PERSEUS_GRADIENT_MOMENTUM": ("0.9", "whole as its residual"),
    "PERSEUS_NCCL_ENABLE": ("1", "special build"),
    "PERSEUS_OFFLINE_NEG": ("1", "never negotiates them per step"),
    "PERSEUS_MASTER_PORT": ("6666", "--started_port"),
    "PERSEUS_NCCL_NETWORK_INTERFACE": ("eth0", "NCCL_SOCKET_IFNAME"),
    "PERSEUS_GLOO_NETWORK_INTERFACE": ("eth0", "--ips"),
    "PERSEUS_CHANGE_HVD_ALLGATHER": ("0", "torch.stack"),
    "PERSEUS_LIBRARY_PATH": ("/root/caffe/libperseus-caffe.so", "PyTorch only"),
    "PERSEUS_ALLREDUCE_STREAMS": ("13", "from 1 to 12"),
    "PERSEUS_ALLREDUCE_FUSION": ("129", "from 0 to 128"),
}


def test_every_vendor_name_of_the_pages_acts_or_is_refused_with_its_reason():
    assert _page_names() == set(vendor_names())
    assert set(ACTS) | set(REFUSED) == set(vendor_names())
    for name, (value, shows) in ACTS.items():
        assert shows(strategy_from_env(value if isinstance(value, dict) else {name: value})), name
    for name, (value, words) in REFUSED.items():
        with pytest.raises(KnobError, match=re.escape(words)):
            strategy_from_env({name: value})
    for knob in VENDOR_KNOBS:
        assert knob.equivalent, knob.name


def test_misspelt_vendor_names_are_refused_with_the_nearest():
    for wrong, right in (("PERSEUS_ALLREDUCE_STREAM", "PERSEUS_ALLREDUCE_STREAMS"),
                         ("TIACC_TRAINING_FUSION_THRESHOLDS", "TIACC_TRAINING_FUSION_THRESHOLD"),
                         ("LIGHT_2D_ALLREDUC", "LIGHT_2D_ALLREDUCE")):
        with pytest.raises(KnobError, match=f"{wrong}=.*did you mean {right}"):
            knob_options({wrong: "1"})
    with pytest.raises(KnobError, match="PERSEUS_ALLREDUCE_GRADIENT_SCALE.*stays fp32"):
        strategy_from_env({"PERSEUS_ALLREDUCE_GRADIENT_SCALE": "5"})
    with pytest.raises(KnobError, match="sets nccl_comm_num=3, but another variable"):
        knob_options({"PERSEUS_ALLREDUCE_STREAMS": "2", "TIACC_TRAINING_NUM_NCCL_STREAMS": "3"})
    # the page's own line: fp16 compression mixed, scale 5
    s = strategy_from_env({"PERSEUS_ALLREDUCE_DTYPE": "2", "PERSEUS_ALLREDUCE_GRADIENT_SCALE": "5"})
    assert s.fp16_allreduce_configs["grad_scale"] == 5.0
    # the environment has the last word over the script's strategy, in every face alike
    assert strategy_with_env(DistributedStrategy(nccl_comm_num=4), {"PERSEUS_ALLREDUCE_STREAMS": "2"}).nccl_comm_num == 2


#: TI-ACC's mpirun line's variables, with a threshold small enough to split the tiny model
TIACC_ENV = {"LIGHT_2D_ALLREDUCE": "0", "TIACC_TRAINING_FUSION_THRESHOLD": "600",
             "TIACC_TRAINING_NUM_NCCL_STREAMS": "2", "PERSEUS_ALLREDUCE_NANHECK": "1"}
STEPS = 3


def _faces(role, rendezvous):
    out = {}
    for style in ("eager", "program"):
        with fleet.session(role, timeout=60):
            model = make_model(100 + role.rank)
            opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
            if style == "eager":
                wrapped = fleet.distributed_model(model)
                for step in range(STEPS):
                    opt.zero_grad()
                    loss_fn(wrapped, batch(step, role.rank)).backward()
                    opt.step()
            else:
                opt.minimize(loss_fn, model)
                exe = Executor()
                exe.run(fleet.startup_program)
                for step in range(STEPS):
                    exe.run(fleet.main_program, feed=batch(step, role.rank))
            out[style] = params(model), [str(e) for e in fleet.applied_strategy()]
    hvd.init(role_maker=role, timeout=60)
    try:
        model = make_model(100 + role.rank)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        for step in range(STEPS):
            opt.zero_grad()
            loss_fn(model, batch(step, role.rank)).backward()
            opt.step()
        s = opt.user_defined_strategy
        out["horovod"] = params(model), (s.nccl_comm_num, s.check_nan_inf, len(opt.reducer.buckets))
    finally:
        hvd.shutdown()
    with torch_group(role, rendezvous):
        ddp = torch.nn.parallel.DistributedDataParallel(make_model(100 + role.rank))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(STEPS):
            opt.zero_grad()
            loss_fn(ddp, batch(step, role.rank)).backward()
            opt.step()
        out["ddp"] = params(ddp.module), None
    return out


@pytest.mark.timeout(150)
def test_tiacc_variables_act_in_the_fleet_and_horovod_faces_and_equal_ddp(tmp_path, monkeypatch):
    for name, value in TIACC_ENV.items():
        monkeypatch.setenv(name, value)
    ranks = run_ranks(_faces, 2, str(tmp_path / "rdv"), timeout=130)
    for out in ranks:
        for face in ("eager", "program", "horovod"):
            assert max_diff(out[face][0], out["ddp"][0]) <= 1e-6, face
        for style in ("eager", "program"):
            applied = out[style][1]
            dp = next(a for a in applied if a.startswith("data_parallel"))
            assert re.search(r"applied \((\d+) buckets of <= 0.000572205 MB over 2 communicator", dp), dp
            assert int(re.search(r"\((\d+) buckets", dp).group(1)) > 1, dp
            assert any(a.startswith("check_nan_inf: applied") for a in applied), applied
        assert out["horovod"][1][:2] == (2, True) and out["horovod"][1][2] > 1, out["horovod"][1]


def test_the_ddp_face_reads_the_same_knobs():
    s = strategy_from_env(TIACC_ENV)
    assert (s.nccl_comm_num, s.check_nan_inf, s.bucket_cap_bytes(), s.use_hierarchical_allreduce) == (2, True, 600, False)


def test_a_bad_variable_stops_fleet_init(monkeypatch):
    from fleetlike.roles import UserDefinedRoleMaker

    monkeypatch.setenv("PERSEUS_ALLREDUCE_DTYPE", "3")
    with pytest.raises(KnobError, match=r"PERSEUS_ALLREDUCE_DTYPE='3' is not accepted; use 0 \(fp16 wire\)"):
        fleet.init(UserDefinedRoleMaker(0, ["127.0.0.1:6170"]))
    assert not fleet.initialized


# ------------------------------------------------------------------ TI-ACC's AMP policy


def test_mixed_precision_policy_takes_the_examples_and_the_tables_calls():
    from fleetlike import adaptfp16, tiacc_torch_warp

    cls = fleetlike.MixedPrecision_TrainingPolicy
    assert tiacc_torch_warp.MixedPrecision_TrainingPolicy is cls and adaptfp16.MixedPrecision_TrainingPolicy is cls
    scaler = torch.amp.GradScaler("cpu")
    # the example: (policy, start_step, hold_step, end_step, test_interval, test_step)
    example = cls(1, 2, 3, 20, 1000, 100)
    table = cls(1, start_time=2, end_time=20, hold_time=3)
    assert (example.start_time, example.hold_time, example.end_time) == (2.0, 3.0, 20.0)
    lrs = [0.1] * 6 + [0.01] * 10
    ex = [example.enable_mixed_precision(e, lr, 1.0, scaler=scaler) for e, lr in enumerate(lrs)]
    tb = [table.enable_mixed_precision(e, scaler, lr=lr, loss=1.0) for e, lr in enumerate(lrs)]
    assert ex == tb == [False, False, True, True, True, True, False, False, False, True, True, True, True, True,
                        True, True]
    loss_policy = cls(2, interval_time=4, interval_hold_time=2)
    assert [loss_policy.enable_mixed_precision(e, scaler, loss=v) for e, v in
            enumerate([1.0, 0.9, 0.8, 0.7, 0.1, 0.09, 0.08])] == [True, True, True, True, False, True, True]
    with pytest.raises(TypeError, match="start_time twice"):
        cls(0, 2, start_time=3)
    with pytest.raises(TypeError, match="unexpected keyword 'start'"):
        cls(0, start=3)
    with pytest.raises(TypeError, match="lr twice"):
        example.enable_mixed_precision(3, 0.1, lr=0.1)

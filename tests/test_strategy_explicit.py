"""Which options the user set: `DistributedStrategy.explicit_options`, kept through copies and
pickles, and what the online tuner makes of it (an option written out at its default value is
as fixed as one set away from it).

The values, ``to_dict`` and equality do not change: two strategies with the same values are
equal whoever set them. The tuner's side runs on one process (`OnlineTuner` over a single
communicator with a made-up clock); the faces' real ranks are in tests/test_autotune.py.
"""

from __future__ import annotations

import copy
import json
import pickle

import pytest

from fleetlike import DistributedStrategy
from fleetlike.comm.single import SingleCommunicator
from fleetlike.config.epl_env import EplConfig
from fleetlike.config.fields import UnknownOptionError
from fleetlike.ddp.state import FleetHookState
from fleetlike.horovod import env as hvd_env
from fleetlike.roles.settings import strategy_with_env
from fleetlike.tune import Knob, OnlineTuner, fixed_reasons, knob_values

TUNE = {"auto_tune": True, "auto_tune_configs": {"steps_per_trial": 2, "warmup_steps": 1, "seconds_per_trial": 0}}
SIZES = [16 * 24 * 4, 24 * 4, 24 * 3 * 4, 3 * 4]


def test_every_way_of_setting_an_option_is_recorded_even_at_its_default():
    s = DistributedStrategy(fuse_grad_size_in_MB=32)  # the default, written out
    assert s == DistributedStrategy() and s.to_dict() == DistributedStrategy().to_dict()
    assert repr(s) == "DistributedStrategy()"
    assert s.explicit_options() == ["fuse_grad_size_in_MB"]
    s.nccl_comm_num = 1  # attribute
    s.amp_configs["dtype"] = "float16"  # a section's key, through the live view
    s.localsgd_configs = {"k_steps": 1}  # a section assigned a dict: only its keys
    s.local_sgd_is_warm_steps = 1  # a 1.x alias: its canonical path
    assert set(s.explicit_options()) == {"fuse_grad_size_in_MB", "nccl_comm_num", "amp_configs.dtype",
                                         "localsgd_configs.k_steps", "localsgd_configs.begin_step"}
    assert s.is_explicit("amp_configs") and s.is_explicit("local_sgd_steps") and not s.is_explicit("amp")
    assert not s.is_explicit("localsgd") and not s.is_explicit("amp_configs.init_loss_scaling")
    with pytest.raises(UnknownOptionError, match="fuse_grad_size_in_mb"):
        s.is_explicit("fuse_grad_size_in_mb")
    assert DistributedStrategy.from_dict({"use_hierarchical_allreduce": False, "amp_configs.dtype": "float16"}
                                         ).explicit_options() == ["amp_configs.dtype", "use_hierarchical_allreduce"]
    bad = DistributedStrategy()
    with pytest.raises(ValueError):
        bad.nccl_comm_num = 0  # a refused value changes nothing, and is not recorded either
    assert bad.explicit_options() == []
    s.reset("fuse_grad_size_in_MB")  # back to the default: free again
    assert "fuse_grad_size_in_MB" not in s.explicit_options()
    s.reset()
    assert s.explicit_options() == []


def test_the_record_survives_copies_and_pickles_and_a_full_dump_is_not_all_explicit():
    s = DistributedStrategy(fuse_grad_size_in_MB=32, amp=True)
    for other in (s.copy(), copy.copy(s), copy.deepcopy(s), pickle.loads(pickle.dumps(s))):
        assert other == s and other.to_dict() == s.to_dict()
        assert other.explicit_options() == ["amp", "fuse_grad_size_in_MB"]
        other.nccl_comm_num = 2  # independent
        assert "nccl_comm_num" not in s.explicit_options()
    # a dict holds every option: as input, each one given counts as set
    assert len(DistributedStrategy.from_dict(s.to_dict()).explicit_options()) == len(DistributedStrategy.option_names())
    assert DistributedStrategy.from_dict(s.to_dict(), explicit=["amp"]).explicit_options() == ["amp"]
    with pytest.raises(UnknownOptionError, match="ampp"):
        DistributedStrategy.from_dict({}, explicit=["ampp"])
    e = EplConfig({"amp.level": "O1"})  # EPL's Config keeps its type and its record
    for other in (e.copy(), pickle.loads(pickle.dumps(e))):
        assert type(other) is EplConfig and other.explicit_options() == ["amp"]
    state = FleetHookState(DistributedStrategy(nccl_comm_num=1))  # the DDP hook's checkpointed state
    assert pickle.loads(pickle.dumps(state)).strategy.explicit_options() == ["nccl_comm_num"]


def test_the_environment_and_the_strategy_variable_count_as_set():
    env = {"FLEETLIKE_STRATEGY": json.dumps({"nccl_comm_num": 1}), "FLEETLIKE_FUSION_MB": "32"}
    s = strategy_with_env(DistributedStrategy(auto_tune=True), env)
    assert {"nccl_comm_num", "fuse_grad_size_in_MB", "auto_tune"} <= set(s.explicit_options())
    assert {Knob.COMM_NUM, Knob.BUCKET_MB} <= set(fixed_reasons(s))
    free = strategy_with_env(DistributedStrategy(auto_tune=True), {"PERSEUS_ALLREDUCE_FUSION": "0"})  # "automatic"
    assert Knob.BUCKET_MB not in fixed_reasons(free) and Knob.COMM_NUM not in fixed_reasons(free)


def _run(strategy, cost, fixed=()):
    clock = {"t": 0.0}
    tuner = OnlineTuner(SingleCommunicator(), strategy, param_bytes=SIZES, two_level_ok=True, apply=lambda _: None,
                        clock=lambda: clock["t"], fixed=fixed)
    for _ in range(200):
        clock["t"] += cost(tuner.current)
        tuner.step_done()
        if tuner.done:
            break
    assert tuner.done
    return tuner


def test_the_tuner_never_moves_a_knob_written_out_at_its_default():
    # every other bucket size and two communicators are 2x faster: a free knob would move
    def cost(st):
        return 0.01 if (st.bucket_mb != 32 or st.comm_num != 1) else 0.02

    free = _run(DistributedStrategy(**TUNE), cost)
    assert free.current.bucket_mb != 32  # the search does move the bucket size when it may
    s = DistributedStrategy(**TUNE, fuse_grad_size_in_MB=32, nccl_comm_num=1, use_hierarchical_allreduce=False)
    s.auto_tune_configs["allow_16bit_wire"] = True
    s.fp16_allreduce_configs = {"dtype": "bfloat16"}  # set alone: the 16-bit trial uses this format only
    assert knob_values(s, param_bytes=SIZES, two_level_ok=True, fixed=set(fixed_reasons(s))) == {
        Knob.WIRE_DTYPE: ["native", "bfloat16"]}
    tuner = _run(s, cost)
    assert {(t.setting.bucket_mb, t.setting.comm_num, t.setting.mode.value) for t in tuner.trials} == {(32, 1, "flat")}
    text = tuner.summary()
    for why in ("bucket_mb (fuse_grad_size_in_MB=32 set explicitly)", "comm_num (nccl_comm_num=1 set explicitly)",
                "allreduce_mode (use_hierarchical_allreduce=False set explicitly)"):
        assert why in text
    # Horovod's variable at its default value fixes the bucket size the same way, and says which
    henv = hvd_env.read({"HOROVOD_FUSION_THRESHOLD": str(32 << 20), "HOROVOD_AUTOTUNE": "1"})
    hs = henv.apply(DistributedStrategy(auto_tune_configs=TUNE["auto_tune_configs"]))
    assert hs == DistributedStrategy(**TUNE)  # the same values as the free job above
    tuned = _run(hs, cost, fixed=henv.fixed_by)
    assert {t.setting.bucket_mb for t in tuned.trials} == {32.0}
    assert f"bucket_mb (HOROVOD_FUSION_THRESHOLD={32 << 20} set explicitly)" in tuned.summary()

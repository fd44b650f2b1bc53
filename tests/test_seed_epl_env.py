"""EPL's configuration through the environment (``EPL_<CATEGORY>_<ATTRIBUTE>``): every key of its
page is settable that way with the same values and refusals as ``epl.Config({...})``; the dict
wins over the variable (EPL's precedence); on 2 ranks a key through a variable trains the same
parameters as through the dict."""

from __future__ import annotations

import os
import re
from unittest import mock

import pytest
import torch

from helpers import max_diff
from test_seed_epl import ACTS, ELSEWHERE, REFUSED, _epl_run, _page_keys
import fleetlike.epl as epl
from fleetlike import DistributedStrategy
from fleetlike.config.epl_env import EPL_ENV_KEYS, EplEnvError, apply_epl_env, epl_variable
from fleetlike.roles.settings import env_settings, strategy_with_env, with_epl_env
from fleetlike.testing import run_ranks

#: values of the large-model and data-input keys, as text and as the dict holds them
ELSEWHERE_VALUES = {
    "pipeline.num_micro_batch": ("4", 4), "pipeline.num_stages": ("2", 2),
    "pipeline.strategy": ("PreferForward", "PreferForward"), "zero.level": ("v1", "v1"),
    "offload.level": ("v0", "v0"), "optimizer.num_apply_group": ("3", 3),
    "io.slicing": ("true", True), "io.unbalanced_io_slicing": ("false", False), "io.drop_last_files": ("True", True),
}


def _text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def test_every_key_of_the_page_has_its_variable_and_acts_as_the_dict_key(monkeypatch):
    keys = _page_keys()
    assert len(keys) == 26 and {epl_variable(k) for k in keys} == set(EPL_ENV_KEYS)
    assert epl_variable("gradient_checkpoint.check_gradients") == "EPL_GRADIENT_CHECKPOINT_CHECK_GRADIENTS"
    for key in keys:
        if key in ACTS:
            text, value = _text(ACTS[key][0]), ACTS[key][0]
        elif key in REFUSED:  # EPL's default, the one value fleetlike honours
            value = not REFUSED[key][0] if isinstance(REFUSED[key][0], bool) else -1
            text = _text(value)
        else:
            assert key.startswith(ELSEWHERE), key
            text, value = ELSEWHERE_VALUES[key]
        by_env = DistributedStrategy()
        assert apply_epl_env(by_env, {epl_variable(key): text}) == {epl_variable(key): text}
        assert by_env == DistributedStrategy.from_dict({key: value}), key
        assert strategy_with_env(None, {epl_variable(key): text}) == by_env, key  # every face's path
        monkeypatch.setenv(epl_variable(key), text)
        assert epl.Config() == by_env, key  # EPL's own form: Config() reads the environment
        monkeypatch.delenv(epl_variable(key))


def test_refused_values_name_the_variable_the_value_and_the_reason():
    for key, (value, words) in REFUSED.items():
        name = epl_variable(key)
        with pytest.raises(EplEnvError, match=rf"{name}='{re.escape(_text(value))}' \(EPL's {re.escape(key)}\) "
                                              rf"is refused: .*{re.escape(words)}"):
            strategy_with_env(None, {name: _text(value)})
    cases = {
        "EPL_AMP_LEVEL": ("O3", r"EPL_AMP_LEVEL='O3' \(EPL's amp.level\) is refused: .*one of '', 'O1'"),
        "EPL_COMMUNICATION_FP16": ("yes", r"EPL_COMMUNICATION_FP16='yes' is not accepted: .*bool.*"
                                          r"EPL_COMMUNICATION_FP16=true"),
        "EPL_COMMUNICATION_NUM_COMMUNICATORS": ("two", r"takes int .*NUM_COMMUNICATORS=1"),
        "EPL_AMP_LOSS_SCALE": ("static", r"'dynamic' or a number.*EPL_AMP_LOSS_SCALE=dynamic"),
        "EPL_COMMUNICATION_FP16_SCALE": ("-2", r"is refused: communication.fp16_scale"),
        "EPL_CLUSTER_RUN_VISIBLE_DEVICES": ("0,x", "GPU id"),
        "EPL_AMP_LEVLE": ("O1", r"not an EPL setting; did you mean EPL_AMP_LEVEL \(EPL's amp.level\)"),
    }
    for name, (text, pattern) in cases.items():
        with pytest.raises(EplEnvError, match=pattern):
            strategy_with_env(None, {name: text})
        with pytest.raises(EplEnvError, match=pattern):
            env_settings({name: text})  # fleet.init's check: the job stops before it trains
    with pytest.warns(UserWarning, match="EPL_SCRIPT_OWN_SETTING is not a variable of EPL's"):
        assert strategy_with_env(None, {"EPL_SCRIPT_OWN_SETTING": "x"}) == DistributedStrategy()


def test_precedence_dict_over_variable_fleetlike_environment_over_both(monkeypatch):
    monkeypatch.setenv("EPL_AMP_LEVEL", "O1")
    monkeypatch.setenv("EPL_COMMUNICATION_NUM_COMMUNICATORS", "3")
    config = epl.Config({"amp.level": ""})
    assert (config.amp, config.nccl_comm_num) == (False, 3)
    # the faces' path does not apply the variables a second time over the dict's keys
    assert strategy_with_env(config).amp is False and strategy_with_env(config.copy()).amp is False
    # a script's own DistributedStrategy: the environment has the last word, as for every knob
    assert strategy_with_env(DistributedStrategy(nccl_comm_num=2)).nccl_comm_num == 3
    # what fleet.distributed_model judges init's strategy by before the first forward
    assert with_epl_env(DistributedStrategy()).amp is True and with_epl_env(config).amp is False
    monkeypatch.setenv("FLEETLIKE_STRATEGY", '{"nccl_comm_num": 4}')
    assert strategy_with_env(config).nccl_comm_num == 4
    monkeypatch.setenv("PERSEUS_ALLREDUCE_STREAMS", "5")
    assert strategy_with_env(config).nccl_comm_num == 5


#: keys that change the trained parameters: sum (not mean), an fp16 wire with its scale, recompute
DICT = {"communication.gradients_reduce_method": "sum", "communication.fp16": True,
        "communication.fp16_scale": 64, "gradient_checkpoint.type": "auto"}


def _train(role, param_dict, environ):
    """`_epl_run` (the page's form, then the PyTorch step) with ``environ`` set around it."""
    with mock.patch.dict(os.environ, environ):
        return _epl_run(role, param_dict)[0]


def _runs(role):
    env = {epl_variable(k): _text(v) for k, v in DICT.items()}
    return {"dict": _train(role, DICT, {}), "env": _train(role, None, env), "plain": _train(role, None, {}),
            "dict_over_env": _train(role, {"communication.gradients_reduce_method": "mean"},
                                    {"EPL_COMMUNICATION_GRADIENTS_REDUCE_METHOD": "sum"})}


@pytest.mark.timeout(120)
def test_keys_through_the_environment_train_as_through_the_dict_on_2_ranks(tmp_path):
    results = run_ranks(_runs, 2, timeout=100)
    for rank, got in enumerate(results):
        assert max_diff(got["env"], got["dict"]) <= 1e-6, rank
        assert max_diff(got["env"], results[0]["env"]) == 0.0, rank  # ranks agree
        assert max_diff(got["dict_over_env"], got["plain"]) <= 1e-6, rank  # the dict's "mean" won
        assert max_diff(got["env"], got["plain"]) > 1e-4, rank  # the variables acted (sum is not mean)


def test_visible_devices_from_the_environment_reach_fleet_init(monkeypatch):
    """EPL's scheduler-set ``cluster.run_visible_devices`` through its variable, with no strategy
    given to ``fleet.init``: the ids are used (here refused: this process trains on the CPU)."""
    from fleetlike import fleet
    from fleetlike.roles import UserDefinedRoleMaker

    if torch.cuda.is_available():
        pytest.skip("the refusal is for processes without CUDA; a GPU run uses the ids")
    monkeypatch.setenv("EPL_CLUSTER_RUN_VISIBLE_DEVICES", "0")
    with pytest.raises(ValueError, match="names GPUs, but this process trains on the CPU"):
        fleet.init(role_maker=UserDefinedRoleMaker(0, ["127.0.0.1:6170"]))
    assert not fleet.initialized

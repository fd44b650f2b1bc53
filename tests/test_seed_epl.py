"""EPL's configuration page (seed 002): its ``Config`` examples run on 2 ranks and give torch DDP's
parameters; every key of the page acts or is refused with its reason; check_gradients catches a
forward that does not recompute the same."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dp_common import torch_group
from helpers import labelled_batch, max_diff, params
import fleetlike.epl as epl
from fleetlike import DistributedStrategy, fleet
from fleetlike.config import StrategyError, UnknownOptionError
from fleetlike.strategies.recompute import apply_recompute
from fleetlike.testing import run_ranks

SEEDS = Path("/work/shared/seeds")
STEPS, WIDTH, ROWS = 4, 16, 8


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Net(torch.nn.Module):
    """Repeated blocks (what EPL's auto GC picks) and a head."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
        self.head = torch.nn.Linear(WIDTH, 3)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _feed(step: int, rank: int) -> dict[str, torch.Tensor]:
    return labelled_batch(step * 31 + rank, ROWS, WIDTH, 3)


def _loss(model, feed):
    return F.cross_entropy(model(feed["x"]).float(), feed["y"])


#: EPL's page's Config examples that concern data-parallel PyTorch training (the pipeline, zero,
#: offload and optimizer examples are the large-model features'), plus the communication keys
#: in one Config; (label, param_dict, tolerance against DDP, DDP's autocast dtype)
EXAMPLES = (
    ("gc_auto", {"gradient_checkpoint.type": "auto"}, 1e-6, None),
    ("gc_collection", {"gradient_checkpoint.type": "collection",
                       "recompute_configs.checkpoints": ["blocks.0", "blocks.2"],
                       "gradient_checkpoint.check_gradients": True}, 1e-6, None),
    ("amp_dynamic", {"amp.level": "O1", "amp.loss_scale": "dynamic"}, 1e-5, torch.float16),
    ("amp_fixed", {"amp.level": "O1", "amp.loss_scale": 128}, 1e-5, torch.float16),
    ("communication", {"communication.num_communicators": 2, "communication.max_splits": 2,
                       "fuse_grad_size_in_MB": 0.0005,
                       "communication.sparse_as_dense": True, "cluster.device_place_prefer_intra_node": True,
                       "communication.gradients_reduce_method": "mean", "auto.auto_parallel": False}, 1e-6, None),
    ("fp16_comm", {"communication.fp16": True, "communication.fp16_scale": 128}, 2e-3, None),
)


def _epl_run(role, param_dict):
    """The page's form: ``config = epl.Config({...}); epl.init(config)``, then the PyTorch step."""
    config = epl.Config(param_dict)
    epl.init(config, role_maker=role, timeout=60)
    try:
        model = Net(7)
        wrapped = fleet.distributed_model(model)
        opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        for step in range(STEPS):
            opt.zero_grad()
            _loss(wrapped, _feed(step, role.rank)).backward()
            opt.step()
        applied = [str(e) for e in fleet.applied_strategy()]
    finally:
        fleet.shutdown()
    return params(model), applied


def _ddp_run(role, dtype):
    model = torch.nn.parallel.DistributedDataParallel(Net(7))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = _loss(model, _feed(step, role.rank))
        loss.backward()
        opt.step()
    return params(model.module)


def _all(role, rendezvous):
    ours = {label: _epl_run(role, d) for label, d, _, _ in EXAMPLES}
    with torch_group(role, rendezvous):
        ddp = {dtype: _ddp_run(role, dtype) for dtype in {e[3] for e in EXAMPLES}}
    return ours, ddp


@pytest.mark.timeout(180)
def test_epl_config_examples_equal_torch_ddp(tmp_path):
    results = run_ranks(_all, 2, str(tmp_path / "rdv"), timeout=160)
    for rank, (ours, ddp) in enumerate(results):
        for label, _, tol, dtype in EXAMPLES:
            got, applied = ours[label]
            assert max_diff(got, ddp[dtype]) <= tol, (rank, label, max_diff(got, ddp[dtype]))
            assert max_diff(got, results[0][0][label][0]) == 0.0, (rank, label)  # ranks agree
            if label.startswith("gc"):
                assert any(a.startswith("recompute: applied") for a in applied), applied
            if label.startswith("amp"):
                assert any(a.startswith("amp: applied") for a in applied), applied
    (_, applied) = results[0][0]["communication"]
    dp = next(a for a in applied if a.startswith("data_parallel"))
    assert re.match(r"data_parallel: applied \(2 buckets .*at most 2: fuse_grad_max_buckets\) over 2 communicator", dp), dp
    assert any(a.startswith("recompute_configs.check_gradients: applied") for a in results[0][0]["gc_collection"][1])
    # the fp16 wire is not the fp32 one (the knob acts) yet within fp16's rounding of it
    assert max_diff(results[0][0]["fp16_comm"][0], results[0][1][None]) > 0.0


# ------------------------------------------------------------------------ every key of the page


def _page_keys() -> list[str]:
    text = next(SEEDS.glob("002_*.txt")).read_text(encoding="utf-8")
    return sorted(set(re.findall(r'"([a-z_]+\.[a-z0-9_]+)"\s*\|', text)))


#: keys of the page owned by the large-model and data-input features (pipeline, ZeRO, offload,
#: grouped apply, file slicing); each is checked where it is implemented
ELSEWHERE = ("pipeline.", "zero.", "offload.", "optimizer.", "io.")

#: key -> (a value EPL documents, what the strategy shows for it); None: refused with a reason
ACTS = {
    "amp.level": ("O1", lambda s: s.amp is True),
    "amp.debug_log": (True, lambda s: s.amp_configs["debug_log"] is True),
    "amp.loss_scale": (64, lambda s: (s.amp_configs["use_dynamic_loss_scaling"], s.amp_configs["init_loss_scaling"])
                       == (False, 64.0)),
    "gradient_checkpoint.type": ("auto", lambda s: s.recompute and s.recompute_configs["checkpoints"] == "auto"),
    "gradient_checkpoint.check_gradients": (True, lambda s: s.recompute_configs["check_gradients"] is True),
    "cluster.run_visible_devices": ("0,1", lambda s: s.visible_devices == (0, 1)),
    "communication.num_communicators": (3, lambda s: s.nccl_comm_num == 3),
    "communication.max_splits": (5, lambda s: s.fuse_grad_max_buckets == 5),
    "communication.fp16": (True, lambda s: s.fp16_allreduce is True),
    "communication.fp16_scale": (128, lambda s: s.fp16_allreduce_configs["grad_scale"] == 128.0),
    "communication.gradients_reduce_method": ("sum", lambda s: s.sharding_configs["gradients_reduce_method"] == "sum"),
    "communication.clip_after_allreduce": (True, lambda s: s.sharding_configs["clip_after_allreduce"] is True),
}
#: key -> (EPL's value fleetlike cannot honour, words of the reason)
REFUSED = {
    "gradient_checkpoint.end_taskgraph": (2, "no taskgraphs"),
    "cluster.device_place_prefer_intra_node": (False, "within one node"),
    "cluster.colocate_split_and_replicate": (True, "one replica per rank"),
    "communication.sparse_as_dense": (False, "densely"),
    "auto.auto_parallel": (True, "fleetlike.plan"),
}


def test_every_key_of_the_page_acts_or_is_refused_with_its_reason():
    keys = [k for k in _page_keys() if not k.startswith(ELSEWHERE)]
    assert len(keys) == 17, keys  # the page's 26 keys less the 9 of the large-model and io features
    assert set(keys) == set(ACTS) | set(REFUSED)
    for key in keys:
        assert "unknown" not in DistributedStrategy.describe(key).lower()
        if key in ACTS:
            value, shows = ACTS[key]
            assert shows(epl.Config({key: value})), key
        else:
            value, words = REFUSED[key]
            with pytest.raises(StrategyError, match=re.escape(words)) as err:
                epl.Config({key: value})
            assert not isinstance(err.value, UnknownOptionError), key
            epl.Config({key: not value if isinstance(value, bool) else -1})  # its default is accepted


def test_misspelt_keys_and_bad_values_are_refused():
    with pytest.raises(UnknownOptionError, match="did you mean 'amp.level'"):
        epl.Config({"amp.levle": "O1"})
    with pytest.raises(UnknownOptionError, match="did you mean 'communication.fp16'"):
        epl.Config({"communication.fp61": True})
    with pytest.raises(ValueError, match=r"amp.level must be one of '', 'O1', got 'O3'"):
        epl.Config({"amp.level": "O3"})
    with pytest.raises(TypeError, match="'dynamic' or a number"):
        epl.Config({"amp.loss_scale": "static"})
    with pytest.raises(ValueError, match="GPU id"):
        epl.Config({"cluster.run_visible_devices": "0,x"})
    assert epl.Config({"gradient_checkpoint.type": ""}).recompute is False
    assert epl.Config({"amp.loss_scale": "dynamic"}).amp_configs["use_dynamic_loss_scaling"] is True


def test_visible_devices_on_a_cpu_process_is_refused():
    if torch.cuda.is_available():
        pytest.skip("the refusal is for processes without CUDA; a GPU run uses the ids")
    from fleetlike.roles import UserDefinedRoleMaker

    with pytest.raises(ValueError, match="names GPUs, but this process trains on the CPU"):
        epl.init(epl.Config({"cluster.run_visible_devices": "0"}), role_maker=UserDefinedRoleMaker(0, ["127.0.0.1:6170"]))
    assert not fleet.initialized


# ------------------------------------------------------------------------ check_gradients


class Drifting(torch.nn.Module):
    """A forward that changes between calls, so its recomputation is not what backward saw."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        self.calls += 1
        return self.lin(x) * torch.full_like(x, float(self.calls))


def test_check_gradients_raises_on_a_forward_that_recomputes_differently():
    model = torch.nn.ModuleDict({"drift": Drifting()})
    apply_recompute(model, ["drift"], check_gradients=True)
    with pytest.raises(RuntimeError, match="'drift' gives different gradients when recomputed"):
        model["drift"](torch.randn(2, 3, requires_grad=True)).sum().backward()


def test_check_gradients_passes_and_changes_nothing_with_dropout_and_batchnorm():
    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3),
                                                       torch.nn.BatchNorm1d(8)), torch.nn.Linear(8, 2))

    def step(model):
        torch.manual_seed(5)
        model(torch.randn(6, 4)).pow(2).sum().backward()
        return [p.grad.clone() for p in model.parameters()], model[0][2].num_batches_tracked.item()

    plain = step(build())
    checked_model = build()
    apply_recompute(checked_model, ["0"], check_gradients=True)
    checked = step(checked_model)
    assert checked[1] == plain[1] == 1  # BatchNorm counted the step once
    assert all(torch.equal(a, b) for a, b in zip(checked[0], plain[0]))

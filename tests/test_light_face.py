"""Light's page (seed 000) as its users call it, in this process and on two gloo ranks: ``light.cc``'s
PyTorch calls (``broadcast_variable`` for a tensor, an optimizer, a dict and a list,
``allgather_object``, ``broadcast_object``), the fusion options of ``get_distributed_optimizer``
and ``fusion_allreduce`` (each against a plain reduction or a one-process reference),
``light.calc`` (``set_cudnn_autotune``, ``FusedOptimizer`` against the unfused optimizer),
``light_init``'s ``pytorch_ddp``, ``enable_optimizations`` and ``application_scenario``, and the
Horovod alias behind ``--accelerate_horovod``."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import numpy as np
import pytest
import torch

import fleetlike
import fleetlike.horovod as hvd
from fleetlike import cc
from fleetlike.calc import FusedOptimizer, set_cudnn_autotune
from fleetlike.horovod import alias
from fleetlike.horovod.light_fusion import fusion_segments
from fleetlike.testing import run_ranks

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "PADDLE_TRAINER_ID",
                "PADDLE_TRAINERS_NUM", "PADDLE_TRAINER_ENDPOINTS", "SLURM_PROCID", "FLEETLIKE_STRATEGY",
                "FLEETLIKE_FUSION_MB", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    hvd.shutdown()
    benchmark = torch.backends.cudnn.benchmark
    yield
    hvd.shutdown()
    torch.backends.cudnn.benchmark = benchmark


# ------------------------------------------------------------------ fusion segments

@pytest.mark.parametrize(("options", "want"), [
    ({"fusion_type": "piecewise_fusion", "piecewise_fusion_schedule": "2;6"}, [[0, 1], [2, 3, 4, 5], [6]]),
    ({"fusion_type": "piecewise_fusion", "piecewise_fusion_schedule": "0"}, [[0, 1, 2, 3, 4, 5, 6]]),
    ({"fusion_type": "piecewise_fusion", "piecewise_fusion_schedule": "3;40"}, [[0, 1, 2], [3, 4, 5, 6]]),
    ({"fusion_type": "auto_fusion", "auto_fusion_threshold": 8}, [[0, 1], [2, 3], [4, 5], [6]]),
    ({"fusion_type": "auto_fusion", "auto_fusion_threshold": 3}, [[0], [1], [2], [3], [4], [5], [6]]),
    ({}, [[0, 1, 2, 3, 4, 5, 6]]),  # Light's default: auto_fusion within 64 MiB
    ({"allreduce_type": "normal"}, [[0], [1], [2], [3], [4], [5], [6]]),
])
def test_fusion_segments_follow_lights_table(options: dict[str, Any], want: list[list[int]]) -> None:
    assert fusion_segments([4] * 7, **options) == want


def test_scopewise_fusion_groups_by_module_path_and_bad_options_are_named() -> None:
    names = ["enc.0.weight", "enc.0.bias", "dec.weight", "head.bias", "enc.1.weight"]
    assert fusion_segments([4] * 5, fusion_type="scopewise_fusion", scopewise_fusion_schedule="enc;dec",
                           names=names) == [[0, 1, 4], [2], [3]]
    with pytest.raises(ValueError, match="named_parameters"):
        fusion_segments([4], fusion_type="scopewise_fusion", scopewise_fusion_schedule="enc")
    with pytest.raises(ValueError, match="jit_scope"):
        fusion_segments([4], fusion_type="xlascope_fusion")
    with pytest.raises(ValueError, match=r"fusion_type='layer'.*auto_fusion"):
        fusion_segments([4], fusion_type="layer")
    with pytest.raises(ValueError, match=r"allreduce_type='fast'"):
        fusion_segments([4], allreduce_type="fast")
    with pytest.raises(ValueError, match="increasing"):
        fusion_segments([4], fusion_type="piecewise_fusion", piecewise_fusion_schedule="6;2")
    with pytest.raises(ValueError, match="auto_fusion_threshold=0"):
        fusion_segments([4], auto_fusion_threshold=0)


# ------------------------------------------------------------------ light.calc

def _train(opt_factory: Any, wrap: bool, steps: int = 4) -> tuple[list[torch.Tensor], Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    opt = opt_factory(model.parameters())
    if wrap:
        opt = FusedOptimizer(opt)
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt


@pytest.mark.parametrize(("factory", "kernel"), [
    (lambda p: torch.optim.Adam(p, lr=0.01), "fused"),
    (lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1), "fused"),
    (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True), "fused"),
    (lambda p: torch.optim.Adagrad(p, lr=0.05), "fused"),
    (lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5), "foreach"),
    (lambda p: torch.optim.Adamax(p, lr=0.01), "foreach"),
])
def test_fused_optimizer_runs_torchs_kernels_and_equals_the_plain_one(factory: Any, kernel: str) -> None:
    plain, _ = _train(factory, wrap=False)
    fused, opt = _train(factory, wrap=True)
    assert opt.kernel == kernel
    assert all(g[kernel] is True for g in opt.origin_optimizer.param_groups)
    assert max(float((a - b).abs().max()) for a, b in zip(plain, fused)) < 1e-6
    assert opt.origin_optimizer.param_groups[0]["params"][0] is opt.param_groups[0]["params"][0]


def test_fused_optimizer_state_dict_round_trips_through_a_plain_optimizer() -> None:
    factory = lambda p: torch.optim.Adam(p, lr=0.01)  # noqa: E731
    whole, _ = _train(factory, wrap=True, steps=4)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    opt = FusedOptimizer(factory(model.parameters()))
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(4)]
    for x, y in batches[:2]:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    saved = opt.state_dict()
    assert saved["param_groups"][0]["fused"] is None  # as the user built it: loads into a plain Adam
    plain = torch.optim.Adam(model.parameters(), lr=0.01)
    plain.load_state_dict(saved)
    resumed = FusedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    resumed.load_state_dict(plain.state_dict())
    assert resumed.param_groups[0]["fused"] is True
    for x, y in batches[2:]:
        resumed.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        resumed.step()
    assert max(float((a - b.detach()).abs().max()) for a, b in zip(whole, model.parameters())) < 1e-6


def test_fused_optimizer_refuses_what_has_no_multi_tensor_kernel() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(TypeError, match="LBFGS has neither a fused nor a foreach"):
        FusedOptimizer(torch.optim.LBFGS([p]))
    with pytest.raises(TypeError, match="wraps a torch.optim.Optimizer"):
        FusedOptimizer("adam")  # type: ignore[arg-type]


def test_light_calc_names_resolve_and_autotune_turns_cudnn_search_on() -> None:
    torch.backends.cudnn.benchmark = False
    assert fleetlike.calc.set_cudnn_autotune is set_cudnn_autotune
    fleetlike.calc.set_cudnn_autotune()
    assert torch.backends.cudnn.benchmark is True


# ------------------------------------------------------------------ light_init

def test_application_scenario_selects_what_the_docs_say() -> None:
    seen: dict[str, Any] = {}
    torch.backends.cudnn.benchmark = False

    def probe(name: str) -> Any:
        def main() -> None:
            model = torch.nn.Linear(3, 2)
            opt = cc.get_distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
            seen[name] = (torch.backends.cudnn.benchmark, opt.user_defined_strategy.fuse_grad_size_in_MB)
        return main

    for scenario in ("default", "Torch-CV", "Torch-GAN", "Torch-NLP"):
        fleetlike.light_init(params={"training_framework": "pytorch", "application_scenario": scenario})(probe(scenario))()
    fleetlike.light_init(params={"training_framework": "pytorch", "application_scenario": "Torch-CV",
                                 "enable_optimizations": False})(probe("off"))()
    default_mb = seen["default"][1]
    assert seen == {"default": (False, default_mb), "Torch-CV": (True, default_mb), "Torch-GAN": (True, default_mb),
                    "Torch-NLP": (False, 64.0), "off": (False, default_mb)}
    assert torch.backends.cudnn.benchmark is False  # restored after main
    with pytest.raises(ValueError, match="TensorFlow scenario"):
        fleetlike.light_init(params={"training_framework": "pytorch_ddp", "application_scenario": "TF-NLP"})


def test_scenario_leaves_a_bucket_size_the_environment_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETLIKE_FUSION_MB", "8")

    @fleetlike.light_init(params={"training_framework": "pytorch_ddp", "application_scenario": "Torch-NLP"})
    def main() -> float:
        import fleetlike.auto as auto

        return float(auto.settings().strategy.fuse_grad_size_in_MB)

    assert main() == 8.0


def test_pytorch_ddp_forms_torchs_group_and_accelerates_ddp_in_one_process() -> None:
    import torch.distributed as dist

    def main() -> tuple[int, bool]:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
        return dist.get_world_size(), bool(model._comm_hooks)

    on = fleetlike.light_init(params={"training_framework": "pytorch_ddp"})(main)
    off = fleetlike.light_init(params={"training_framework": "pytorch_ddp", "enable_optimizations": False})(main)
    assert on() == (1, True)
    assert not dist.is_initialized()  # destroyed when main returned
    assert off() == (1, False)  # plain torch DDP: no fleetlike hook
    assert "fleetlike.ddp.auto" not in sys.modules or sys.modules["fleetlike.ddp.auto"]._SETTINGS is None
    assert dist.init_process_group is importlib.import_module("torch.distributed.distributed_c10d").init_process_group


# ------------------------------------------------------------------ the Horovod alias

def test_horovod_alias_answers_horovod_torch_only_while_installed() -> None:
    assert not alias.installed()
    with pytest.raises(ImportError):
        importlib.import_module("horovod.torch")
    alias.install()
    try:
        assert importlib.import_module("horovod.torch") is hvd
        assert importlib.import_module("horovod.torch.elastic") is hvd.elastic
        with pytest.raises(ImportError, match="PyTorch API only"):
            importlib.import_module("horovod.tensorflow")
    finally:
        alias.uninstall()
    with pytest.raises(ImportError):
        importlib.import_module("horovod.torch")


# ------------------------------------------------------------------ light.cc on two ranks

@pytest.mark.timeout(120)
def test_light_cc_calls_on_two_ranks() -> None:
    results = run_ranks(_cc_rank, 2, timeout=100)
    ref = _reference_params()
    for r, res in enumerate(results):
        np.testing.assert_array_equal(res["tensor"], [5.0, 6.0])
        assert res["dict"] == results[0]["dict"] and res["list"] == results[0]["list"]
        assert res["opt_lr"] == 0.5 and res["opt_state"] == results[0]["opt_state"]
        assert res["objects"] == [{"rank": 0}, {"rank": 1}]
        assert res["object"] == ("from", 1)
        for fused in res["fusion"].values():
            for got, want in zip(fused, res["plain"]):
                np.testing.assert_allclose(got, want, rtol=0, atol=1e-7)
        assert res["pairs"][1] == "bias"
        assert res["buckets"] == {"piecewise": 3, "auto": 2, "normal": 4, "default": 1}
        for got, want in zip(res["params"], ref):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def _batch(r: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(20 + r)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


def _reference_params() -> list[np.ndarray]:
    """One process on both ranks' batches: the average of the two mean losses' gradients."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [_batch(0), _batch(1)]
    for _ in range(3):
        opt.zero_grad()
        sum(torch.nn.functional.mse_loss(model(x), y) for x, y in batches).div(2).backward()
        opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


def _cc_rank(role: Any) -> dict[str, Any]:
    import fleetlike.horovod as hvd
    from fleetlike import cc

    hvd.init(role_maker=role)
    try:
        r = cc.rank()
        out: dict[str, Any] = {}
        t = torch.tensor([5.0, 6.0]) if r == 1 else torch.zeros(2)
        cc.broadcast_variable(t, root_rank=1)
        out["tensor"] = t.numpy()
        torch.manual_seed(r)
        m = torch.nn.Linear(2, 2)
        cc.broadcast_variable(m.state_dict(), root_rank=0)
        out["dict"] = [p.tolist() for p in m.parameters()]
        m2 = torch.nn.Linear(2, 1)
        cc.broadcast_variable(list(m2.parameters()), root_rank=0)
        out["list"] = [p.tolist() for p in m2.parameters()]
        opt = torch.optim.Adam(m.parameters(), lr=0.5 if r == 0 else 0.1)
        m(torch.full((1, 2), float(r))).sum().backward()
        opt.step()
        cc.broadcast_variable(opt, root_rank=0)
        out["opt_lr"] = opt.param_groups[0]["lr"]
        out["opt_state"] = [v["exp_avg"].tolist() for v in opt.state.values()]
        out["objects"] = cc.allgather_object({"rank": r})
        out["object"] = cc.broadcast_object(("from", r), root_rank=1)
        tensors = [torch.full((3,), float(r + i)) for i in range(5)]
        out["plain"] = [cc.allreduce(x).numpy() for x in tensors]
        out["fusion"] = {
            "auto": [x.numpy() for x in cc.fusion_allreduce(tensors, fusion_type="auto_fusion",
                                                            auto_fusion_threshold=24)],
            "piecewise": [x.numpy() for x in cc.fusion_allreduce(tensors, fusion_type="piecewise_fusion",
                                                                 piecewise_fusion_schedule="2;4")],
            "normal": [x.numpy() for x in cc.fusion_allreduce(tensors, allreduce_type="normal")],
        }
        pairs = cc.fusion_allreduce([(tensors[0], "weight"), (tensors[1], "bias")], fusion_type="scopewise_fusion",
                                    scopewise_fusion_schedule="weight")
        out["fusion"]["scopewise"] = [g.numpy() for g, _ in pairs] + list(out["plain"][2:])
        out["pairs"] = pairs[1]
        out["buckets"] = {}
        for kind, options in (("piecewise", {"fusion_type": "piecewise_fusion", "piecewise_fusion_schedule": "1;3"}),
                              ("auto", {"fusion_type": "auto_fusion", "auto_fusion_threshold": 4 * 15}),
                              ("normal", {"allreduce_type": "normal"}), ("default", {})):
            model = _model()
            dist_opt = cc.get_distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                    named_parameters=model.named_parameters(), **options)
            out["buckets"][kind] = len(dist_opt.reducer.buckets)
            x, y = _batch(r)
            for _ in range(3):
                dist_opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                dist_opt.step()
            if kind == "piecewise":
                out["params"] = [p.detach().numpy().copy() for p in model.parameters()]
        return out
    finally:
        hvd.shutdown()


@pytest.mark.timeout(120)
def test_lights_distributed_amp_example_on_two_ranks() -> None:
    """The page's "Light distributed amp" loop: ``get_distributed_optimizer``, ``GradScaler``,
    ``optimizer.synchronize()`` then ``scaler.step`` under ``skip_synchronize()`` (on CPU the
    scaler is torch's CPU one; its power-of-two scale is undone exactly)."""
    results = run_ranks(_amp_rank, 2, timeout=100)
    ref = _reference_params()
    for res in results:
        assert res["scale"] == 65536.0  # the scaler was active
        for got, want in zip(res["params"], ref):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def _amp_rank(role: Any) -> dict[str, Any]:
    import fleetlike.horovod as hvd
    from fleetlike import cc

    hvd.init(role_maker=role)
    try:
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        optimizer = cc.get_distributed_optimizer(optimizer)
        scaler = torch.amp.GradScaler("cpu")
        x, y = _batch(cc.rank())
        for _ in range(3):
            optimizer.zero_grad()
            with torch.autocast("cpu", enabled=False):
                loss = torch.nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            optimizer.synchronize()
            with optimizer.skip_synchronize():
                scaler.step(optimizer)
                scaler.update()
        return {"scale": float(scaler.get_scale()), "params": [p.detach().numpy().copy() for p in model.parameters()]}
    finally:
        hvd.shutdown()

"""Light's names (``fleetlike.cc``) and ``@fleetlike.light_init``: the same functions as the
Horovod face under Light's spelling, checked against it on two gloo ranks, and the decorator's
parameters and life cycle in this process."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import fleetlike
import fleetlike.horovod as hvd
from fleetlike import cc
from fleetlike.testing import run_ranks


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    for var in ("RANK", "WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM",
                "PADDLE_TRAINER_ENDPOINTS", "SLURM_PROCID", "FLEETLIKE_STRATEGY"):
        monkeypatch.delenv(var, raising=False)
    hvd.shutdown()
    yield
    hvd.shutdown()


def test_light_init_initialises_and_shuts_down() -> None:
    seen = {}

    @fleetlike.light_init(params={"training_framework": "pytorch", "application_scenario": "Torch-CV"})
    def main(x: int) -> int:
        seen["inside"] = (cc.size(), cc.rank(), cc.local_size(), cc.local_rank(), hvd.is_initialized())
        return x + 1

    assert main.__name__ == "main"
    assert main(1) == 2
    assert seen["inside"] == (1, 0, 1, 0, True)
    assert not hvd.is_initialized()

    @fleetlike.light_init(params={"training_framework": "pytorch"})
    def failing() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        failing()
    assert not hvd.is_initialized()  # shut down on the way out of an error too


def test_light_init_params_are_checked() -> None:
    with pytest.raises(KeyError, match="unknown key.*'framework'.*valid keys"):
        fleetlike.light_init(params={"framework": "pytorch"})
    with pytest.raises(ValueError, match="PyTorch models only"):
        fleetlike.light_init(params={"training_framework": "tensorflow"})
    with pytest.raises(ValueError, match="choose one of"):
        fleetlike.light_init(params={"training_framework": "jax"})
    with pytest.raises(ValueError, match="application_scenario='CV'"):
        fleetlike.light_init(params={"training_framework": "pytorch", "application_scenario": "CV"})
    with pytest.raises(TypeError, match="enable_optimizations must be a bool"):
        fleetlike.light_init(params={"training_framework": "pytorch", "enable_optimizations": "yes"})


def test_enable_optimizations_false_uses_unfused_buckets() -> None:
    @fleetlike.light_init(params={"training_framework": "pytorch", "enable_optimizations": False})
    def main() -> int:
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
        opt = cc.get_distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        return len(opt.reducer.buckets)

    assert main() == 4  # one bucket per gradient


@pytest.mark.timeout(90)
def test_light_names_equal_the_horovod_face_on_two_ranks() -> None:
    results = run_ranks(_light_rank, 2, timeout=80)
    for r, res in enumerate(results):
        assert res["size"] == (2, r, 2, r)
        np.testing.assert_allclose(res["allreduce"], [0.5, 1.5])
        np.testing.assert_allclose(res["sum"], [1.0, 3.0])
        for got, want in zip(res["fusion"], ([1.0, 1.0], [2.0, 2.0, 2.0])):
            np.testing.assert_allclose(got, want)
        np.testing.assert_array_equal(res["allgather"], [0, 0, 1])
        np.testing.assert_array_equal(res["broadcast"], [7.0])
        assert res["optimizer"] == "HorovodOptimizer"
        np.testing.assert_array_equal(res["params"], results[0]["params"])


def _light_rank(role: Any) -> dict[str, Any]:
    import torch

    import fleetlike.horovod as hvd
    from fleetlike import cc

    hvd.init(role_maker=role)  # what light_init does from a launcher's environment
    try:
        r = cc.rank()
        out: dict[str, Any] = {"size": (cc.size(), r, cc.local_size(), cc.local_rank())}
        out["allreduce"] = cc.allreduce(torch.tensor([float(r), float(r + 1)])).numpy()
        out["sum"] = cc.allreduce(torch.tensor([float(r), float(r + 1)]), op=cc.Sum).numpy()
        out["fusion"] = [t.numpy() for t in cc.fusion_allreduce([torch.ones(2) * (r + 1), torch.ones(3) * 2],
                                                                 average=True)]
        out["fusion"][0] = out["fusion"][0] - 0.5  # (1 + 2) / 2 = 1.5 -> 1.0 after the shift
        out["allgather"] = cc.allgather(torch.arange(r + 1)).numpy()
        out["broadcast"] = cc.broadcast(torch.tensor([7.0 if r == 1 else 0.0]), root_rank=1).numpy()
        torch.manual_seed(r)  # different starts: the optimizer's averaged steps must not fix that,
        model = torch.nn.Linear(3, 1)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # the broadcast does
        opt = cc.get_distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(),
                                           compression=cc.Compression.none, op=cc.Average)
        for step in range(2):
            opt.zero_grad()
            model(torch.full((4, 3), float(r + step))).sum().backward()
            opt.step()
        out["optimizer"] = type(opt).__name__
        out["params"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
        return out
    finally:
        hvd.shutdown()

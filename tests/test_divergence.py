"""The divergence guard in every face, on real gloo ranks: one rank's parameter is changed after
the starting broadcast, and every rank stops naming that parameter and the ranks that differ.

One job of 3 ranks runs, in turn:

* the DDP face (`fleetlike.auto`, check every 2 backward passes): rank 1 changes ``2.bias``
  after ``DDP(...)`` broadcast it; the second backward raises on every rank;
* the plain-loop face (``fleet.distributed_model`` + ``fleet.distributed_optimizer``, every 2
  steps): rank 2 changes ``0.weight`` after step 1; the check after step 2 raises on every
  rank, and an unperturbed run of the same loop trains to the end (no false alarm);
* the Horovod face: ``hvd.broadcast_parameters`` passes, then rank 1 changes ``0.bias`` and
  ``hvd.DistributedOptimizer`` (every 2 steps) raises after its second step;

and `checksums` is compared with an independent bit-level sum in numpy.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_common import dyadic_batch, dyadic_model
from dp_common import torch_group
from fleetlike.collectives.divergence import DEFAULT_EVERY, DivergenceError, DivergenceGuard, checksums
from fleetlike.config.envvars import DIVERGENCE_CHECK_N_STEPS as ENV_VAR
from fleetlike.roles.settings import env_settings, every_from_env
from fleetlike.roles import Role
from fleetlike.testing import run_ranks


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, n: int, poke=None) -> str:
    """``n`` SGD steps; ``poke(step)`` may change a parameter after a step; the error met, if any."""
    try:
        for step in range(n):
            x, t = dyadic_batch(rank, step)
            opt.zero_grad()
            (model(x) * t).sum().backward()
            opt.step()
            if poke is not None:
                poke(step)
        return "no error"
    except (DivergenceError, RuntimeError) as exc:  # DDP re-raises a hook's error as RuntimeError
        return f"step {step}: {exc}"


def _bump(model: torch.nn.Module, name: str) -> None:
    with torch.no_grad():
        dict(model.named_parameters())[name].add_(0.5)


def _faces(role: Role, rendezvous: str) -> dict[str, str]:
    import fleetlike.auto as auto
    import fleetlike.horovod as hvd
    from fleetlike import DistributedStrategy, fleet

    os.environ[ENV_VAR] = "2"
    out: dict[str, str] = {}
    with torch_group(role, rendezvous):
        auto.install(dict(os.environ))
        try:
            ddp = DDP(dyadic_model())
            if role.rank == 1:
                _bump(ddp.module, "2.bias")
            out["ddp"] = _steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.125), role.rank, 4)
        finally:
            auto.uninstall()
    for poke_rank in (None, 2):
        fleet.init(role, timeout=60)
        model = fleet.distributed_model(dyadic_model())
        opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.125), DistributedStrategy())
        poke = (lambda step: _bump(model.module, "0.weight") if step == 0 else None) if role.rank == poke_rank else None
        out[f"fleet_{poke_rank}"] = _steps(model, opt, role.rank, 4, poke)
        fleet.shutdown()
    hvd.init(role_maker=role, timeout=60.0)
    try:
        model = dyadic_model()
        if role.rank == 0:
            _bump(model, "0.bias")  # before the broadcast: it takes rank 0's values, the guard agrees
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        if role.rank == 1:
            _bump(model, "0.bias")
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.125),
                                       named_parameters=model.named_parameters())
        out["hvd"] = _steps(model, opt, role.rank, 4)
    finally:
        hvd.shutdown()
    return out


@pytest.mark.timeout(150)
def test_guard_fires_in_every_face(tmp_path):
    results = run_ranks(_faces, 3, str(tmp_path / "rdzv"), timeout=130)
    for r, res in enumerate(results):
        assert res["ddp"].startswith("step 1:") and "'2.bias'" in res["ddp"] and "rank 1 alone" in res["ddp"], res["ddp"]
        assert "ranks [0, 2] agree" in res["ddp"] and f"rank {r}:" in res["ddp"], res["ddp"]
        assert res["fleet_None"] == "no error", res["fleet_None"]
        f = res["fleet_2"]
        assert f.startswith("step 1:") and "'0.weight'" in f and "rank 2 alone" in f and "after step 2" in f, f
        h = res["hvd"]
        assert h.startswith("step 1:") and "'0.bias'" in h and "rank 1 alone" in h and "hvd.DistributedOptimizer" in h, h


def test_checksums_are_the_bit_sums() -> None:
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(5, 7, generator=g), torch.randn(3, generator=g).double(), torch.randn(4, generator=g).half(),
               torch.arange(6)]
    want = [int(t.numpy().view({4: np.int32, 8: np.int64, 2: np.int16}[t.element_size()]).astype(np.int64).sum())
            if t.is_floating_point() else int(t.numpy().sum()) for t in tensors]
    assert checksums(tensors).tolist() == want
    bumped = [t.clone() for t in tensors]
    bumped[0][2, 3] = torch.nextafter(bumped[0][2, 3], torch.tensor(10.0))  # one ulp of one element
    assert checksums(bumped).tolist()[0] != want[0] and checksums(bumped).tolist()[1:] == want[1:]
    assert every_from_env({}) is None and every_from_env({ENV_VAR: "0"}) == 0
    assert env_settings({ENV_VAR: " 7 "}).divergence_every == 7
    for bad in ("-3", "x"):
        with pytest.raises(ValueError, match=f"{ENV_VAR}='{bad}' is not accepted; use an integer >= 0"):
            every_from_env({ENV_VAR: bad})
    # unset: the guard's own default
    assert DivergenceGuard(None, [], every=every_from_env({})).every == DEFAULT_EVERY == 200  # type: ignore[arg-type]

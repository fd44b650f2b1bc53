"""`fleetlike.auto` meets the job the script formed, on real gloo ranks (no launcher variables).

The ranks join torch.distributed themselves through ``init_method="file://..."`` with explicit
rank and world size, as a ``mp.spawn`` script does: nothing in the environment says how many
ranks there are, so fleetlike can only know the job from the script's own group. One job of
4 ranks compares, from the same initial model and per-rank batches (exact dyadic arithmetic):

* DDP on the default group under `fleetlike.auto` == plain DDP, on every rank;
* DDP on two subgroups {0, 1} and {2, 3} under `fleetlike.auto` == plain DDP on those subgroups
  (the two halves see different data, so an average over the whole job would differ);
* the script's own comm hook on a model built under `fleetlike.auto` (torch's allreduce_hook;
  a hook of its own wrapping `fleetlike_hook`): no crash, the parameters of plain DDP;
* communicators of another size than the model's group raise `WorldMismatchError` at once.
"""

# No ``from __future__ import annotations``: DDP checks a hook's annotations as objects.
import contextlib
import io

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_common import dyadic_batch, dyadic_model
from dp_common import torch_group
from fleetlike import DistributedStrategy
from fleetlike.comm import CommGroups, SingleCommunicator
from fleetlike.roles import Role
from fleetlike.testing import run_ranks

STEPS = 3
LR = 0.125


def _train(ddp: DDP, rank: int) -> list[np.ndarray]:
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    for step in range(STEPS):
        x, t = dyadic_batch(rank, step)
        (ddp(x) * t).sum().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().numpy().copy() for p in ddp.parameters()]


def _wrapping_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A script's hook that composes with fleetlike's: counts buckets, then averages through it."""
    from fleetlike.ddp import fleetlike_hook

    state["buckets"] += 1  # type: ignore[index]
    return fleetlike_hook(state["fleetlike"], bucket)  # type: ignore[index]


def _cases(role: Role, rendezvous: str) -> dict[str, object]:
    import fleetlike.auto as auto
    from fleetlike.ddp import FleetHookState, register
    from fleetlike.ddp.world import WorldMismatchError, groups_for

    out: dict[str, object] = {}
    with torch_group(role, rendezvous):
        halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        mine = halves[role.rank // 2]
        out["ddp"] = _train(DDP(dyadic_model(), bucket_cap_mb=0.0005), role.rank)
        out["ddp_sub"] = _train(DDP(dyadic_model(), process_group=mine), role.rank)
        auto.install({})
        try:
            ddp = DDP(dyadic_model(), bucket_cap_mb=0.0005)
            out["world_size"] = auto.settings().by_param[id(next(ddp.parameters()))].groups.world.size
            out["auto"] = _train(ddp, role.rank)
            out["auto_sub"] = _train(DDP(dyadic_model(), process_group=mine), role.rank)
            ddp = DDP(dyadic_model())
            with contextlib.redirect_stderr(io.StringIO()) as said:
                ddp.register_comm_hook(None, default_hooks.allreduce_hook)  # the script's own hook wins
            out["said"] = said.getvalue()
            out["own_hook"] = _train(ddp, role.rank)
            ddp = DDP(dyadic_model(), bucket_cap_mb=0.0005)
            state = {"buckets": 0, "fleetlike": FleetHookState(model=ddp)}
            ddp.register_comm_hook(state, _wrapping_hook)
            out["wrapped"] = _train(ddp, role.rank)
            out["wrapped_buckets"] = state["buckets"]
            try:
                ddp.register_comm_hook(None, default_hooks.allreduce_hook)
                out["twice"] = "no error"
            except RuntimeError as exc:
                out["twice"] = str(exc)
        finally:
            auto.uninstall()
        alone = CommGroups(SingleCommunicator(), Role.from_endpoints(0, ["127.0.0.1:1"]))
        try:
            register(DDP(dyadic_model()), DistributedStrategy(), groups=alone)
            out["alone"] = "no error"
        except WorldMismatchError as exc:
            out["alone"] = str(exc)
        out["same_groups"] = groups_for(mine) is groups_for(mine)
    return out


@pytest.mark.timeout(120)
def test_auto_meets_the_scripts_group(tmp_path):
    results = run_ranks(_cases, 4, str(tmp_path / "rdzv"), timeout=100)
    for r, res in enumerate(results):
        assert res["world_size"] == 4, res["world_size"]
        for name, ref in (("auto", "ddp"), ("auto_sub", "ddp_sub"), ("own_hook", "ddp"), ("wrapped", "ddp")):
            for a, b in zip(res[name], res[ref]):
                np.testing.assert_array_equal(a, b, err_msg=f"{name} rank {r}")
        # the subgroups really differ from the job-wide average (else the test could not fail)
        assert any(not np.array_equal(a, b) for a, b in zip(res["ddp_sub"], res["ddp"]))
        assert res["wrapped_buckets"] >= STEPS
        assert "can only be called once" in res["twice"], res["twice"]
        assert "span 1" in res["alone"] and "group of 4 rank(s)" in res["alone"], res["alone"]
        assert res["same_groups"]
    for r in (1, 3):  # each subgroup's members agree, and the two halves differ
        for a, b in zip(results[r]["auto_sub"], results[r - 1]["auto_sub"]):
            np.testing.assert_array_equal(a, b)
    said = [res["said"] for res in results]
    assert said[0].count("\n") == 1 and "allreduce_hook; fleetlike's hook steps aside" in said[0], said
    assert said[1:] == ["", "", ""], said  # one line, from rank 0

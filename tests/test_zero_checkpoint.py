"""Checkpoints of ZeRO stages 2 and 3: each rank writes its shard of the optimizer state, the
model is saved whole (consolidated); a resume at the same world size continues exactly, one at
another world size (2 -> 3 ranks) and into another stage (stage 3 -> plain data parallel, data
parallel -> stage 3, stage 2 -> stage 3 and back) continues as the uninterrupted single-process
run; the consolidated files load into plain PyTorch on one process; a checkpoint of another
model is refused naming it."""

from __future__ import annotations

import pytest
import torch

from fleetlike import DistributedStrategy, fleet
from fleetlike.fleet.checkpoint import CheckpointError, consolidate_optimizer_state, read_file
from fleetlike.testing import run_ranks
from zero_common import STEPS, TinyLM, batch, loss_fn, make_opt, reference, rel_diff, state

HALF = STEPS // 2
STAGE3 = {"sharding": True, "sharding_configs": {"sharding_degree": 0, "stage": 3}}
DP: dict = {}


def _train(role, opts: dict, start: int, stop: int, load: str | None = None, save: str | None = None,
           model: torch.nn.Module | None = None) -> dict:
    wrapped = fleet.distributed_model(model if model is not None else TinyLM())
    opt = fleet.distributed_optimizer(make_opt("momentum", wrapped.parameters()), DistributedStrategy.from_dict(opts))
    if load:
        fleet.load_persistables(None, load)
    for step in range(start, stop):
        opt.zero_grad()
        loss_fn(wrapped, batch(step, role.rank, role.world_size)).backward()
        opt.step()
        if save and step == HALF - 1:
            if opts.get("sharding") or role.rank == 0:  # unsharded: one rank writes it (not collective)
                fleet.save_persistables(None, save)
            fleet.barrier_worker()
    return state(fleet.full_state_dict(wrapped))


def _first(role, root: str) -> dict:
    with fleet.session(role, timeout=60):
        out = {"whole": _train(role, STAGE3, 0, STEPS, save=f"{root}/stage3")}
    with fleet.session(role, timeout=60):
        out["resumed"] = _train(role, STAGE3, HALF, STEPS, load=f"{root}/stage3")
    with fleet.session(role, timeout=60):
        out["dp_from_3"] = _train(role, DP, HALF, STEPS, load=f"{root}/stage3")
    with fleet.session(role, timeout=60):
        _train(role, DP, 0, HALF, save=f"{root}/dp")
    with fleet.session(role, timeout=60):
        out["3_from_dp"] = _train(role, STAGE3, HALF, STEPS, load=f"{root}/dp")
    with fleet.session(role, timeout=60):
        other = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        try:
            _train(role, STAGE3, 0, 0, load=f"{root}/stage3", model=other)
            out["other"] = "no error"
        except CheckpointError as exc:
            out["other"] = str(exc)
    return out


def _three(role, root: str, opts: dict = STAGE3, name: str = "stage3") -> dict:
    with fleet.session(role, timeout=60):
        return {"3_ranks": _train(role, opts, HALF, STEPS, load=f"{root}/{name}")}


def _consolidated(path: str) -> dict:
    """The checkpoint's consolidated model and optimizer in plain PyTorch, one process, trained
    from the middle to the end."""
    model = TinyLM()
    model.load_state_dict(read_file(path, "models.pt")[0])
    opt = make_opt("momentum", model.parameters())
    opt.load_state_dict(consolidate_optimizer_state(path))
    return reference("momentum", model=model, opt=opt, start=HALF)


@pytest.mark.timeout(240)
def test_stage3_checkpoints_resume_across_world_sizes_and_stages(tmp_path):
    root = str(tmp_path)
    two = run_ranks(_first, 2, root, timeout=200)
    three = run_ranks(_three, 3, root, timeout=100)
    ref = reference("momentum")
    for r, res in enumerate(two):
        assert rel_diff(res["whole"], ref) <= 1e-5
        assert rel_diff(res["resumed"], res["whole"]) == 0, r  # exactly where it left off
        assert rel_diff(res["dp_from_3"], ref) <= 1e-5, r
        assert rel_diff(res["3_from_dp"], ref) <= 1e-5, r
        assert "does not fit model 0" in res["other"] and "stage3" in res["other"], res["other"]
    for r, res in enumerate(three):
        assert rel_diff(res["3_ranks"], ref) <= 1e-5, r
    # the consolidated files in plain PyTorch, one process: the same continuation
    assert rel_diff(_consolidated(f"{root}/stage3"), ref) <= 1e-5
    shards = sorted(p.name for p in (tmp_path / "stage3").glob("shard-*.pt"))
    assert shards == ["shard-00000.pt", "shard-00001.pt"]


STAGE2 = {"sharding": True, "sharding_configs": {"sharding_degree": 0, "stage": 2}}


def _stage2_first(role, root: str) -> dict:
    runs = [("whole", STAGE2, 0, STEPS, None, "stage2"), ("resumed", STAGE2, HALF, STEPS, "stage2", None),
            ("3_from_2", STAGE3, HALF, STEPS, "stage2", None), (None, STAGE3, 0, HALF, None, "stage3"),
            ("2_from_3", STAGE2, HALF, STEPS, "stage3", None)]
    out = {}
    for key, opts, start, stop, load, save in runs:  # each job in a session of its own
        with fleet.session(role, timeout=60):
            got = _train(role, opts, start, stop, load=load and f"{root}/{load}", save=save and f"{root}/{save}")
        if key:
            out[key] = got
    return out


@pytest.mark.timeout(240)
def test_stage2_checkpoints_resume_across_world_sizes_and_stages(tmp_path):
    """Stage 2 (the bucket engine: each rank's partition of the optimizer state, stage 1's
    layout) resumes exactly at the same world size, and as the uninterrupted run at 3 ranks and
    into stage 3; a stage 3 checkpoint (dim-0 pieces) resumes at stage 2."""
    root = str(tmp_path)
    two = run_ranks(_stage2_first, 2, root, timeout=200)
    three = run_ranks(_three, 3, root, STAGE2, "stage2", timeout=100)
    ref = reference("momentum")
    for r, res in enumerate(two):
        assert rel_diff(res["whole"], ref) <= 1e-5
        assert rel_diff(res["resumed"], res["whole"]) == 0, r
        assert rel_diff(res["3_from_2"], ref) <= 1e-5, r
        assert rel_diff(res["2_from_3"], ref) <= 1e-5, r
    for r, res in enumerate(three):
        assert rel_diff(res["3_ranks"], ref) <= 1e-5, r
    assert rel_diff(_consolidated(f"{root}/stage2"), ref) <= 1e-5

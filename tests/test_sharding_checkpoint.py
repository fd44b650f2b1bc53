"""Sharded checkpoints that change world size: saved by 4 sharded ranks, loaded by 2
and 3 sharded ranks and by 1 unsharded process, and back (2 -> 4, unsharded 2 -> sharded 4),
each continuing to equal an uninterrupted run; a sharded checkpoint consolidated into a plain
``torch.optim.Adam`` continues the same way; a gradient-merge window cut in the middle is
resharded (its partial sums merged) and equals the uninterrupted run; a save cut short leaves
the previous checkpoint, and so does a full disk under one rank's shard (every rank says so).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from ckpt_common import bitwise_equal
from fleetlike import DistributedStrategy, fleet
from fleetlike.fleet.checkpoint import consolidate_optimizer_state, read_file
from fleetlike.testing import run_ranks
from sharding_common import SMALL, Net, batch, loss_fn, make_opt, max_diff, reference, scheduler, weights

SHARDED = {**SMALL, "sharding": True, "sharding_configs": {"sharding_degree": 0}}
MERGE = {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}}


def _run(role, plan: list[tuple]) -> list:
    """Each item: (sharded, merge, load_from, save_to, start, stop); returns each one's weights."""
    out = []
    for sharded, merge, src, dst, start, stop in plan:
        options = {**(SHARDED if sharded else SMALL), **(MERGE if merge else {})}
        with fleet.session(role, timeout=60):
            model = fleet.distributed_model(Net(100 + role.rank))
            opt = fleet.distributed_optimizer(make_opt("adam", model.module), DistributedStrategy.from_dict(options))
            sched = scheduler(opt)
            fleet.register_state("sched", sched)
            if src:
                fleet.load_persistables(None, src)
            for step in range(start, stop):
                opt.zero_grad()
                loss_fn(model, batch(step, role.rank, role.world_size)).backward()
                opt.step()
                sched.step()
            if dst and (sharded or role.rank == 0):  # sharded: every rank writes its shard
                fleet.save_persistables(None, dst)
            out.append(weights(model.module))
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_checkpoints_reshard_between_world_sizes(tmp_path):
    c4, c2, c2u, m4 = (str(tmp_path / n) for n in ("c4", "c2", "c2u", "m4"))
    ref = reference("adam", 6)
    at4 = run_ranks(_run, 4, [(True, False, None, c4, 0, 3),
                              (True, True, None, m4, 0, 3),      # a merge window cut after 1 of 2
                              (True, True, None, None, 0, 6)], timeout=120)
    manifest = json.loads(Path(c4, "fleet.json").read_text())
    assert manifest["sharding"]["world_size"] == 4 and len(manifest["sharding"]["shards"]) == 4
    owners = manifest["sharding"]["layouts"][0]["owners"]
    assert sorted(set(owners)) == [0, 1, 2, 3]
    at2 = run_ranks(_run, 2, [(True, False, c4, None, 3, 6),
                              (True, False, c4, c2, 3, 4),
                              (False, False, None, c2u, 0, 3),
                              (True, True, m4, None, 3, 6)], timeout=120)
    at3 = run_ranks(_run, 3, [(True, False, c4, None, 3, 6)], timeout=60)
    at1 = run_ranks(_run, 1, [(False, False, c4, None, 3, 6)], timeout=60)
    back = run_ranks(_run, 4, [(True, False, c2, None, 4, 6), (True, False, c2u, None, 3, 6)], timeout=120)
    for res in at2:
        assert max_diff(res[0], ref) <= 1e-6
        assert max_diff(res[3], at4[0][2]) <= 1e-6  # merge window resharded == uninterrupted
    assert max_diff(at4[0][1], at4[0][2]) > 1e-4  # (the cut run had not yet reached the end)
    for res in at3 + at1:
        assert max_diff(res[0], ref) <= 1e-6
    for res in back:
        assert max_diff(res[0], ref) <= 1e-6 and max_diff(res[1], ref) <= 1e-6

    # one process, plain torch: the consolidated state is an ordinary Adam state_dict
    model = Net(7)
    model.load_state_dict(read_file(c4, "models.pt")[0])
    opt = make_opt("adam", model)
    full = consolidate_optimizer_state(c4)
    assert set(full) == {"state", "param_groups"} and len(full["state"]) == len(list(model.parameters()))
    opt.load_state_dict(full)
    sched = scheduler(opt)
    sched.load_state_dict(read_file(c4, "extras.pt")["sched"])
    assert max_diff(reference("adam", 6, model=model, opt=opt, sched=sched, start=3), ref) <= 1e-6


def _full_disk_on_rank_1(role, root: str) -> tuple[str, list[str]]:
    """Save, train on, then save again while rank 1's shard goes to /dev/full (every write there
    fails with ENOSPC); then load: the state of the first save, bit for bit."""
    import builtins

    from fleetlike.fleet import checkpoint_files

    target = Path(root) / "c"
    real_open = builtins.open

    def full_for_my_shard(path, mode="r", *args, **kwargs):
        if Path(path).name == f"shard-{role.rank:05d}.pt" and "w" in mode:
            return real_open("/dev/full", mode, *args, **kwargs)
        return real_open(path, mode, *args, **kwargs)

    with fleet.session(role, timeout=60):
        model = fleet.distributed_model(Net(100 + role.rank))
        opt = fleet.distributed_optimizer(make_opt("adam", model.module), DistributedStrategy.from_dict(SHARDED))

        def step(i: int) -> None:
            opt.zero_grad()
            loss_fn(model, batch(i, role.rank, role.world_size)).backward()
            opt.step()

        step(0)
        fleet.save_persistables(None, str(target))
        saved = (weights(model.module), copy.deepcopy(opt.state_dict()))
        step(1)
        if role.rank == 1:
            checkpoint_files.open = full_for_my_shard  # shadows the builtin inside save_pt
        try:
            fleet.save_persistables(None, str(target))
        except Exception as exc:  # noqa: BLE001 - handed to the test
            message = str(exc)
        else:
            message = ""
        finally:
            vars(checkpoint_files).pop("open", None)
        fleet.load_persistables(None, str(target))
        now = (weights(model.module), opt.state_dict())
        differs = [f"weights {max_diff(now[0], saved[0])}"] if max_diff(now[0], saved[0]) else []
        differs += [f"optimizer {k}" for k in sorted(set(now[1]) | set(saved[1]))
                    if not bitwise_equal(_sorted(now[1].get(k)), _sorted(saved[1].get(k)))]
    return message, differs


def _sorted(value):
    """``value`` with every dict's keys in sorted order (a load rebuilds the state in its own order)."""
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value, key=repr)}
    if isinstance(value, (list, tuple)):
        return type(value)(_sorted(v) for v in value)
    return value


@pytest.mark.timeout(90)
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full, where every write fails with ENOSPC")
def test_a_full_disk_on_one_rank_fails_every_rank_and_keeps_the_previous_checkpoint(tmp_path):
    target = tmp_path / "c"
    results = run_ranks(_full_disk_on_rank_1, 2, str(tmp_path), timeout=80)
    tail = f"the previous checkpoint {target} is intact. Free space there (or save elsewhere) and save again"
    assert results[1][0] == f"no space left on {tmp_path} while saving {target} (No space left on device); {tail}"
    assert results[0][0] == (f"no space left on {tmp_path} while saving {target} (rank 1's shard) "
                             f"(No space left on device); {tail}")
    assert [differs for _, differs in results] == [[], []]  # the previous checkpoint, loaded on every rank
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no temporary directory left

"""`fleetlike.elastic`'s states in one process: commit / restore against the values a plain
copy would hold (the random generators too), on-disk copies every K commits, validation;
``hvd.elastic`` is the module. One 3-rank run checks where the generators go at a sync."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fleetlike.elastic as elastic
from fleetlike import fleet
from fleetlike.io import DistributedSampler
from fleetlike.testing import run_ranks


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(5, 4, generator=g)).square().sum().backward()
    opt.step()


def _generators() -> tuple[torch.Tensor, object, tuple]:  # type: ignore[type-arg]
    """The process-wide generators, read with torch's, Python's and NumPy's own calls."""
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def _same_generators(a: tuple, b: tuple) -> bool:  # type: ignore[type-arg]
    return (torch.equal(a[0], b[0]) and a[1] == b[1] and a[2][0] == b[2][0] and np.array_equal(a[2][1], b[2][1])
            and a[2][2:] == b[2][2:])


def _draw() -> list[float]:
    """What a training step draws: a dropout mask, a Python and a NumPy number."""
    mask = torch.nn.functional.dropout(torch.ones(8), 0.5)
    return [*mask.tolist(), random.random(), float(np.random.rand())]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from(["train", "commit", "restore", "bump", "draw"]), max_size=12))
def test_restore_returns_to_the_last_commit(ops: list[str]) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = elastic.TorchState(model=model, optimizer=opt, epoch=0, seen=[])
    committed = None  # the reference: deep copies taken at each commit
    generators = _generators()  # what the generators were at the last commit (at first: now)
    for i, op in enumerate(ops):
        if op == "draw":
            _draw()
        elif op == "train":
            _train(model, opt, i)
            state.seen.append(i)
        elif op == "bump":
            state.epoch += 1
        elif op == "commit":
            state.commit()
            committed = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()),
                         state.epoch, list(state.seen))
            generators = _generators()
        else:
            before = _generators()
            state.restore()
            # back to the commit's generators; before any commit nothing changes
            assert _same_generators(_generators(), generators if committed is not None else before)
            if committed is not None:
                params, opt_state, epoch, seen = committed
                assert all(torch.equal(model.state_dict()[k], v) for k, v in params.items())
                assert opt.state_dict()["state"].keys() == opt_state["state"].keys()
                for k, v in opt_state["state"].items():
                    assert torch.equal(opt.state_dict()["state"][k]["momentum_buffer"], v["momentum_buffer"])
                assert (state.epoch, state.seen) == (epoch, seen)
    assert state.commits == ops.count("commit")


def test_on_disk_every_k_commits_and_load(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dataset = list(range(20))
    sampler = DistributedSampler(dataset, num_replicas=2, rank=1, seed=3)
    state = elastic.TorchState(model=model, optimizer=opt, sampler=sampler, step=0,
                               directory=tmp_path / "ckpt", save_every=2)
    assert state.load() is False  # nothing written yet
    taken = iter(sampler)
    for _ in range(3):
        next(taken)
    _train(model, opt, 0)
    state.step = 1
    state.commit()
    assert not (tmp_path / "ckpt").exists()  # the first commit stays in memory
    state.step = 2
    state.commit()
    saved = copy.deepcopy(model.state_dict())
    _train(model, opt, 1)
    state.step = 3
    state.commit()  # odd: not written

    fresh = _model()
    sampler2 = DistributedSampler(dataset, num_replicas=2, rank=1, seed=3)
    other = elastic.TorchState(model=fresh, optimizer=torch.optim.SGD(fresh.parameters(), lr=0.1),
                               sampler=sampler2, step=0, directory=tmp_path / "ckpt", save_every=2)
    assert other.load() is True
    assert other.step == 2 and other.commits == 2
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.items())
    # the sampler continues the epoch where the commit was: rank 1's share after 3 samples
    expected = sampler.order()[6:][1::2]
    assert list(sampler2) == expected


def _generators_at_sync(role) -> dict[str, bool]:  # type: ignore[no-untyped-def]
    """Where the generators go when `sync` hands a commit out (3 ranks, each seeded apart)."""
    fleet.init(role, timeout=60)
    rank = role.rank
    torch.manual_seed(10 + rank)
    random.seed(10 + rank)
    np.random.seed(10 + rank)
    state = elastic.TorchState(model=torch.nn.Linear(2, 2), step=0)
    state._in_run = True  # what elastic.run sets: a commit gathers every rank's generators
    _draw()
    state.commit()
    after_commit = _draw()  # what each rank drew right after the commit
    _draw()  # and then some more (a step the failure cut short)
    out = {}
    state.restore()  # a survivor rolling back in place
    out["survivor draws again"] = _draw() == after_commit
    if rank == 2:  # rank 2 dies; its replacement starts afresh (its own seed) and gets the commit
        torch.manual_seed(42)
        random.seed(42)
        np.random.seed(42)
        state = elastic.TorchState(model=torch.nn.Linear(2, 2), step=0)
    state.sync(root=0)
    out["each rank draws its own after the sync"] = _draw() == after_commit and state.commits == 1
    state._in_run = False  # a commit outside elastic.run: no collective, only this rank's generators
    state.commit()
    mine = _generators()
    _draw()
    moved = _generators()
    state.sync(root=0)
    # rank 0 rolls back to its commit; the others, with no generators from the root, keep theirs
    out["ranks the root has none for keep theirs"] = _same_generators(_generators(), mine if rank == 0 else moved)
    fleet.shutdown()
    return out


@pytest.mark.timeout(120)
def test_a_sync_gives_each_rank_its_committed_generators() -> None:
    for rank, out in enumerate(run_ranks(_generators_at_sync, 3, timeout=100)):
        assert out and all(out.values()), (rank, out)


def test_bad_input_is_named() -> None:
    with pytest.raises(TypeError, match="TorchState\\(model=...\\)"):
        elastic.TorchState(model="net")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="save_every=0"):
        elastic.ObjectState(save_every=0, epoch=0)
    with pytest.raises(ValueError, match="directory=PATH"):
        elastic.ObjectState(epoch=0).load()
    with pytest.raises(TypeError, match="not callable"):
        elastic.ObjectState(epoch=0).register_reset_callbacks([3])  # type: ignore[list-item]
    calls: list[int] = []
    state = elastic.ObjectState(epoch=0)
    state.register_reset_callbacks([lambda: calls.append(1), lambda: calls.append(2)])
    state.on_reset()
    assert calls == [1, 2]


def test_horovod_elastic_names_ride_this_module() -> None:
    """hvd.elastic is Horovod's name space over this module: its states are this module's (with
    Horovod's check_host_updates), its interrupt is the same class, its run drives the same
    re-formation inside an elastic job."""
    import fleetlike.horovod as hvd
    import fleetlike.horovod.elastic as hvd_elastic

    assert hvd.elastic is hvd_elastic
    assert {"State", "TorchState", "ObjectState", "run", "HostsUpdatedInterrupt"} <= set(hvd_elastic.__all__)
    assert hvd_elastic.HostsUpdatedInterrupt is elastic.HostsUpdatedInterrupt
    for name in ("State", "TorchState", "ObjectState"):
        assert issubclass(getattr(hvd_elastic, name), getattr(elastic, name))
        assert callable(getattr(getattr(hvd_elastic, name), "check_host_updates"))

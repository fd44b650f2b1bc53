"""A checkpoint never half-loads, names what is wrong with it, and leaves nothing behind.

Every kind of checkpoint (program style, eager style, sharded, elastic state) is saved by a job
of one process, then each of its files is removed, emptied, truncated or corrupted at chosen
and at drawn positions: the load names the file and the cause, and the job's models,
optimizers (strategy state included), registered objects and elastic state are bit for bit
what they were. A checkpoint of the format before per-file versions (tests/fixtures, written by
that code) still loads, with one notice. A full filesystem, kill -9 during saves, leftovers of
other writers, objects a checkpoint cannot hold, and torch's random generator.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt_common import FIXTURES, KINDS, Job, bitwise_equal, build, one_process
from fleetlike import Executor, elastic, fleet
from fleetlike.fleet.checkpoint import CheckpointError, read_file, resolve
from fleetlike.fleet.checkpoint_files import COMPLETE, make_tag, remove_leftovers, seal, verify
from fleetlike.testing import preloaded_context


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """One good checkpoint of every kind (the jobs that load them are built by each test)."""
    root = tmp_path_factory.mktemp("saved")
    for kind in KINDS:
        with one_process():
            build(kind, seed=3, steps=2).save(root / kind)
    return {kind: root / kind for kind in KINDS}


def _damage(path: Path, how: str, at: int) -> None:
    data = path.read_bytes()
    if how == "missing":
        path.unlink()
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "truncated":
        path.write_bytes(data[: at % len(data)])
    elif how == "corrupted":
        i = at % len(data)
        path.write_bytes(data[:i] + bytes([data[i] ^ 0x5A]) + data[i + 1 :])
    else:
        raise ValueError(how)


def _try_damaged(job: Job, good: Path, work: Path, name: str, how: str, at: int) -> str:
    """Load ``good`` with file ``name`` damaged into ``job``; the error, the job unchanged."""
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(good, work)
    _damage(work / name, how, at)
    before = job.snapshot()
    with pytest.raises(CheckpointError) as err:
        job.load(work)
    assert bitwise_equal(job.snapshot(), before), f"{name} {how} at {at}: the job's state changed"
    return str(err.value)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", KINDS)
def test_each_damaged_file_is_named_and_nothing_changes(kind, saved, tmp_path):
    good = saved[kind]
    names = sorted(p.name for p in good.iterdir())
    assert COMPLETE in names and len(names) >= 2
    with one_process():
        job = build(kind, seed=8, steps=3)  # its state differs from the checkpoint's everywhere
        for name in names:
            size = (good / name).stat().st_size
            for how, at in [("missing", 0), ("empty", 0), ("truncated", 1), ("truncated", size // 2),
                            ("truncated", size - 1), ("corrupted", 0), ("corrupted", size // 2),
                            ("corrupted", size - 1)]:
                msg = _try_damaged(job, good, tmp_path / "work", name, how, at)
                assert name in msg, (name, how, at, msg)
                word = {"missing": "missing", "empty": "empty", "truncated": "truncated"}.get(how, "corrupt")
                if name != COMPLETE or how not in ("missing", "empty"):
                    assert word in msg, (name, how, at, msg)
                assert "load an earlier checkpoint" in msg, msg
        job.load(good)  # and the good one still loads into the same job


@pytest.mark.timeout(120)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_damage_at_any_position_is_caught(data, saved, tmp_path):
    kind = data.draw(st.sampled_from(KINDS))
    good = saved[kind]
    name = data.draw(st.sampled_from(sorted(p.name for p in good.iterdir())))
    how = data.draw(st.sampled_from(["truncated", "corrupted"]))
    at = data.draw(st.integers(0, (good / name).stat().st_size - 1))
    with one_process():
        job = build(kind, seed=8, steps=1)
        msg = _try_damaged(job, good, tmp_path / f"work-{kind}", name, how, at)
    assert name in msg


def _expected(kind: str) -> dict:
    """What the fixture's job held when it saved: the same job rebuilt (seeded, deterministic)."""
    with one_process():
        job = build(kind, seed=5, steps=3)
        if job.state is not None:
            job.state.save()
            job.state.commits = 1
        return job.snapshot()


@pytest.mark.timeout(120)
def test_checkpoints_of_the_previous_format_still_load_with_one_notice(caplog, tmp_path):
    for kind in KINDS:
        want = _expected(kind)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fleetlike"), one_process():
            job = build(kind, seed=9, steps=1)
            job.load(FIXTURES / kind)
            assert bitwise_equal(job.snapshot(), want), kind
            notices = [r.getMessage() for r in caplog.records if "format 2" in r.getMessage()]
            assert len(notices) == 1 and str(FIXTURES / kind) in notices[0] and "save it again" in notices[0]
            job.save(tmp_path / kind)  # saving it again writes the current format
        assert json.loads((tmp_path / kind / COMPLETE).read_text())["format"] == 3
    # the plain-PyTorch readers take either format
    assert bitwise_equal(read_file(FIXTURES / "eager", "models.pt"), read_file(tmp_path / "eager", "models.pt"))


def _reseal(path: Path) -> None:
    (path / COMPLETE).unlink()
    seal(path)


@pytest.mark.timeout(60)
def test_wrong_version_and_missing_key_are_named_with_the_fix(saved, tmp_path):
    work = tmp_path / "c"
    with one_process():
        job = build("eager", seed=8, steps=1)
        before = job.snapshot()

        shutil.copytree(saved["eager"], work)
        meta = json.loads((work / "fleet.json").read_text())
        del meta["strategy"]
        (work / "fleet.json").write_text(json.dumps(meta))
        _reseal(work)
        with pytest.raises(CheckpointError, match=r"fleet.json lacks 'strategy'.*load an earlier checkpoint"):
            job.load(work)

        meta["strategy"], meta["format"] = {}, 2
        (work / "fleet.json").write_text(json.dumps(meta))
        _reseal(work)
        with pytest.raises(CheckpointError, match=r"fleet.json says format 2, its directory's COMPLETE says 3"):
            job.load(work)

        marker = json.loads((work / COMPLETE).read_text())
        (work / COMPLETE).write_text(json.dumps({**marker, "format": 99}))
        with pytest.raises(CheckpointError, match=r"format 99 .*reads formats 2-3"):
            job.load(work)

        shutil.rmtree(work)
        shutil.copytree(saved["eager"], work)
        shutil.copy(saved["program"] / "models.pt", work / "optimizers.pt")  # a file of another kind
        _reseal(work)
        with pytest.raises(CheckpointError, match=r"optimizers.pt is 'models' of format 3.*different saves"):
            job.load(work)
        assert bitwise_equal(job.snapshot(), before)

    # an elastic state.pt without a format version that is not the old layout either
    state = elastic.ObjectState(epoch=4, directory=tmp_path / "e")
    (tmp_path / "e").mkdir()
    torch.save({"epoch": 1}, tmp_path / "e" / "state.pt")
    (tmp_path / "e" / COMPLETE).write_text("ok\n")
    with pytest.raises(CheckpointError, match=r"state.pt has no format version and is not a State.save_to_disk file"):
        state.load()
    assert state.epoch == 4 and state.commits == 0


class _Blob:
    """A registered object whose state is as large as asked."""

    def __init__(self, n: int) -> None:
        self.data = torch.zeros(n)

    def state_dict(self) -> dict:
        return {"data": self.data}

    def load_state_dict(self, state: dict) -> None:
        self.data = state["data"]


class _Refuses(_Blob):
    """Takes back only the state it holds (a failure of the load, not of putting back)."""

    def load_state_dict(self, state: dict) -> None:
        if not torch.equal(state["data"], self.data):
            raise ValueError("this object refuses every other state")


@pytest.mark.timeout(60)
def test_a_failure_while_applying_puts_everything_back(tmp_path):
    with one_process():
        job = build("program", seed=8, steps=2)
        blob = _Refuses(3)
        fleet.register_state("blob", blob)
        job.extras["blob"] = blob
        job.save(tmp_path / "c")
        job.step(5)
        blob.data = torch.ones(3)
        before = job.snapshot()
        with pytest.raises(CheckpointError, match="could not be applied .*refuses every other state.*was put back as it was"):
            job.load(tmp_path / "c")  # the optimizer was applied first, then put back
        assert bitwise_equal(job.snapshot(), before)


@pytest.mark.timeout(60)
def test_a_model_that_fails_half_way_is_put_back_and_a_plain_one_is_never_copied(tmp_path, monkeypatch):
    """A plain model (torch's load_state_dict, no hooks) is applied last, without a copy of its
    weights; a model whose loading may fail is held like everything else, and when it fails with
    its first layer already overwritten, the whole job is put back."""
    from fleetlike.fleet import checkpoint as ckpt

    with one_process():
        job = build("program", seed=9, steps=2)
        model = job.models[0]
        job.save(tmp_path / "c")
        held: list = []
        hold = ckpt._hold
        monkeypatch.setattr(ckpt, "_hold", lambda obj: held.append(obj) or hold(obj))
        job.step(5)
        job.load(tmp_path / "c")
        assert held == [*job.optimizers, *job.extras.values()]  # the model: no copy
        assert bitwise_equal(job.snapshot()["models"], [ckpt.read_file(tmp_path / "c", "models.pt")[0]])

        saved = ckpt.read_file(tmp_path / "c", "models.pt")[0]
        overwritten: list[bool] = []

        def refuse(module, state_dict, prefix, *_: object) -> None:  # the checkpoint's state only
            if torch.equal(state_dict[prefix + "weight"], saved["2.weight"]):
                overwritten.append(torch.equal(model[0].weight, saved["0.weight"]))
                raise ValueError("the last layer refuses")

        model[2].register_load_state_dict_pre_hook(refuse)
        assert ckpt._why_unsafe(model, model.state_dict()) == "module '2' has load_state_dict hooks"
        job.step(6)
        before = job.snapshot()
        assert not torch.equal(model[0].weight, saved["0.weight"])
        held.clear()
        with pytest.raises(CheckpointError, match="could not be applied .*the last layer refuses.*was put back as it was"):
            job.load(tmp_path / "c")
        assert overwritten == [True] and held == [*job.optimizers, *job.extras.values(), model]
        assert bitwise_equal(job.snapshot(), before)


@pytest.mark.timeout(60)
def test_a_save_refuses_objects_a_checkpoint_cannot_hold(tmp_path):
    class Custom:
        pass

    with one_process():
        job = build("eager", seed=1, steps=1)
        job.save(tmp_path / "c")
        blob = _Blob(2)
        fleet.register_state("blob", blob)
        blob.data = {"top1": [np.float64(0.25), np.int64(3)], "dtype": torch.float16}  # plain values: kept
        job.save(tmp_path / "c")
        blob.data = None
        job.load(tmp_path / "c")
        assert blob.data == {"top1": [0.25, 3], "dtype": torch.float16} and type(blob.data["top1"][0]) is np.float64
        blob.data = {"inner": [1, Custom()]}
        with pytest.raises(CheckpointError, match=r"extras.pt: registered objects\['blob'\]\['data'\]\['inner'\]\[1\] "
                                                  r"is a .*Custom, which a checkpoint cannot hold"):
            job.save(tmp_path / "c")
    assert verify(resolve(tmp_path / "c")) == 3  # the previous one untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_leftovers_are_removed_only_when_provably_stale(tmp_path):
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / COMPLETE).write_text("ok\n")
    host, _, _ = make_tag().rsplit("-", 2)
    dead = subprocess.Popen(["true"])
    dead.wait()
    names = {
        "dead": f".ckpt.tmp-{host}-{dead.pid}-0000abcd",     # this machine, its writer is gone
        "dead_old": f".ckpt.old-{host}-{dead.pid}-0000abce",
        "alive": f".ckpt.tmp-{host}-{os.getppid()}-0000abcf",  # a writer still running: kept
        "other_host": ".ckpt.tmp-elsewhere-123-0000abd0",      # cannot check: kept while fresh
        "legacy_fresh": ".ckpt.tmp-1a2b3c4d",
        "legacy_stale": ".ckpt.old-5e6f7a8b",
        "other_ckpt": f".other.tmp-{host}-{dead.pid}-0000abd1",  # another checkpoint's
    }
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "models.pt").write_bytes(b"x")
    week = time.time() - 7 * 86400
    for path in [tmp_path / names["legacy_stale"], tmp_path / names["legacy_stale"] / "models.pt"]:
        os.utime(path, (week, week))
    removed = {p.name for p in remove_leftovers(target)}
    assert removed == {names["dead"], names["dead_old"], names["legacy_stale"]}
    assert all((tmp_path / n).exists() for n in set(names.values()) - removed)
    # while the checkpoint itself is incomplete, a moved-aside one is what `resolve` falls back to
    (tmp_path / names["dead_old"]).mkdir()
    (tmp_path / names["dead_old"] / COMPLETE).write_text("ok\n")
    shutil.rmtree(target)
    assert remove_leftovers(target) == [] and resolve(target) == tmp_path / names["dead_old"]


@pytest.mark.timeout(60)
def test_the_sharded_save_leaves_torchs_random_numbers_alone(tmp_path):
    draws = []
    for save in (False, True):
        with one_process():
            job = build("sharded", seed=1, steps=1)
            torch.manual_seed(1234)
            if save:
                job.save(tmp_path / "c")
            draws.append(torch.rand(5))
    assert (tmp_path / "c" / "shard-00000.pt").exists()
    assert torch.equal(draws[0], draws[1])


# ------------------------------------------------------------------ a full filesystem


@pytest.fixture
def tiny_fs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a 1 MiB tmpfs to fill ({proc.stderr.strip() or proc.returncode}): needs root")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.timeout(60)
def test_a_full_disk_names_the_directory_and_the_intact_previous_checkpoint(tiny_fs):
    with one_process():
        job = build("program", seed=2, steps=1)
        blob = _Blob(10)
        fleet.register_state("blob", blob)
        job.save(tiny_fs / "c")
        want = job.snapshot()
        blob.data = torch.ones(400_000)  # 1.6 MB: more than the filesystem holds
        with pytest.raises(CheckpointError) as err:
            job.save(tiny_fs / "c")
        assert f"no space left on {tiny_fs}" in str(err.value)
        assert f"the previous checkpoint {tiny_fs / 'c'} is intact" in str(err.value)
        assert sorted(p.name for p in tiny_fs.iterdir()) == ["c"]  # its temporary directory removed
        blob.data = torch.ones(7)
        job.load(tiny_fs / "c")
        assert bitwise_equal(job.snapshot(), want)

    state = elastic.ObjectState(blob=torch.zeros(10), directory=tiny_fs / "e")
    state.commit()
    state.blob = torch.ones(400_000)
    with pytest.raises(CheckpointError, match=f"no space left on {tiny_fs}.*previous checkpoint {tiny_fs / 'e'} is intact"):
        state.commit()
    state.blob = None
    assert state.load() and torch.equal(state.blob, torch.zeros(10))


# ------------------------------------------------------------------ kill -9 during saves


def _save_forever(dirname: str, counter: str, go: str) -> None:
    with one_process():
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(12)])  # ~3 MB
        opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        opt.minimize(lambda m, f: m(f).sum(), model)
        Executor().run(fleet.startup_program)
        while not os.path.exists(go):  # started while the previous saver still ran
            time.sleep(0.002)
        version = 0
        while True:
            version += 1
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float(version))
            fleet.save_persistables(None, dirname)
            Path(counter).write_text(str(version))


def _versions(dirname: Path) -> set[float]:
    models = read_file(dirname, "models.pt")
    return {float(v) for sd in models for t in sd.values() for v in t.unique()}


@pytest.mark.timeout(120)
def test_kill_9_during_saves_then_one_save_leaves_nothing_behind(tmp_path, tmp_path_factory):
    ckpt, counter, gos = tmp_path / "ckpt", tmp_path / "counter", tmp_path_factory.mktemp("go")
    rng = random.Random(33)
    landed = 0
    ctx = preloaded_context()
    started = []

    def saver(attempt: int):  # type: ignore[no-untyped-def]
        go = gos / str(attempt)
        started.append(ctx.Process(target=_save_forever, args=(str(ckpt), str(counter), str(go))))
        started[-1].start()
        return started[-1], go

    # each saver starts and builds its model while the previous one saves, and saves only once
    # told to (`go`), after the previous one is dead
    following = saver(0)
    try:
        for attempt in range(5):
            proc, go = following
            counter.unlink(missing_ok=True)
            go.touch()
            if attempt < 4:
                following = saver(attempt + 1)
            try:
                deadline = time.monotonic() + 30
                while not counter.exists() and time.monotonic() < deadline:
                    time.sleep(0.005)
                if attempt % 2:
                    time.sleep(rng.uniform(0.0, 0.4))  # any moment of a later save
                else:  # inside a save for certain, however slow the machine makes each step
                    while not list(tmp_path.glob(".ckpt.tmp-*")) and time.monotonic() < deadline:
                        time.sleep(0.001)
                landed += bool(list(tmp_path.glob(".ckpt.tmp-*")))
                os.kill(proc.pid, signal.SIGKILL)
            finally:
                proc.join(10)
            assert proc.exitcode == -signal.SIGKILL
            assert len(_versions(resolve(ckpt))) == 1  # one complete version, not a mixture
    finally:
        for proc in started:  # a saver not yet told to go, when an assertion ended the loop
            if proc.exitcode is None:
                proc.kill()
                proc.join(10)
    assert landed >= 1  # some kills did land inside a save
    last = _versions(resolve(ckpt))
    # one save (of another job) in the same place: every leftover of the killed ones goes
    with one_process():
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(12)])
        opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        opt.minimize(lambda m, f: m(f).sum(), model)
        Executor().run(fleet.startup_program)
        fleet.load_persistables(None, str(ckpt))  # the last complete checkpoint loads
        assert {float(v) for p in model.parameters() for v in p.detach().unique()} == last
        fleet.save_persistables(None, str(ckpt))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "counter"]

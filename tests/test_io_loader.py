"""get_data_loader: torch's batches, a state at the delivered batches (prefetch runs ahead), the
data-wait time (the loader's and the slow-rank report's), errors from the prefetch thread; on
real gloo ranks: resume through fleet's checkpoint == the uninterrupted order, a resize restart
sees the rest once, the even tail keeps ranks in step, and a rank with a slow input pipeline
is named by the slow-rank report in both styles.

References: torch's DataLoader with torch's DistributedSampler; the uninterrupted run.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.data import DistributedSampler as TorchSampler

from fleetlike import DistributedStrategy, Executor, fleet
from fleetlike.io import DistributedSampler, get_data_loader
from fleetlike.strategies.health import DATA_WAIT
from fleetlike.testing import run_ranks


def indexed(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1), torch.arange(n))


class Slow(Dataset):
    """Index dataset whose items take ``delay`` seconds (a slow decode); may fail at ``bad``."""

    def __init__(self, n: int, delay: float = 0.0, bad: int | None = None) -> None:
        self.n, self.delay, self.bad = n, delay, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == self.bad:
            raise ValueError(f"sample {i} is broken")
        if self.delay:
            time.sleep(self.delay)
        return torch.tensor([float(i)]), i


def labels(loader) -> list[list[int]]:
    return [b[1].tolist() for b in loader]


@pytest.mark.timeout(90)
def test_batches_are_torch_dataloaders():
    ds = indexed(23)
    for workers in (0, 2):
        for prefetch in (0, 3):
            for rank in range(3):
                ours = get_data_loader(ds, 4, 3, rank, seed=2, num_workers=workers, prefetch=prefetch, drop_last=rank == 1)
                theirs = DataLoader(ds, 4, sampler=TorchSampler(ds, 3, rank, seed=2), num_workers=workers, drop_last=rank == 1)
                for epoch in (0, 1):
                    ours.set_epoch(epoch)
                    theirs.sampler.set_epoch(epoch)
                    assert labels(ours) == labels(theirs), (workers, prefetch, rank, epoch)
                assert len(ours) == len(theirs)
                assert ours.num_workers == workers and ours.dataset is ds  # DataLoader's attributes


@pytest.mark.timeout(60)
def test_state_is_at_the_delivered_batches_while_prefetch_runs_ahead():
    ds = indexed(40)
    full = get_data_loader(ds, 3, 2, 1, seed=4, prefetch=0)
    full.set_epoch(1)
    expected = labels(full)
    loader = get_data_loader(ds, 3, 2, 1, seed=4, num_workers=2, prefetch=4)
    loader.set_epoch(1)
    it = iter(loader)
    got = [next(it)[1].tolist() for _ in range(2)]
    time.sleep(0.3)  # let the prefetch thread and the workers run well ahead
    state = loader.state_dict()
    assert loader.sampler._yielded > 2 * 3  # fetched ahead of the delivered batches
    assert state["sampler"]["offset"] == 2 * 3 * 2  # 2 batches of 3 on each of 2 ranks
    del it
    resumed = get_data_loader(ds, 3, 2, 1, seed=0, prefetch=2)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)  # the resumed epoch: keeps the position
    assert got + labels(resumed) == expected
    # a finished pass is saved as a finished epoch
    assert resumed.state_dict()["sampler"]["offset"] == 40
    resumed.set_epoch(2)
    assert len(labels(resumed)) == len(expected)


@pytest.mark.timeout(60)
def test_wait_time_is_measured_and_reaches_the_report():
    DATA_WAIT.take()
    loader = get_data_loader(Slow(12, delay=0.01), 2, 1, 0, prefetch=0)
    steps = 0
    for _ in loader:
        assert loader.last_wait >= 2 * 0.01  # two slow samples per batch, fetched in this thread
        steps += 1
    assert steps == loader.steps == 6 and loader.epoch_wait >= 12 * 0.01
    assert DATA_WAIT.take() == pytest.approx(loader.epoch_wait)
    fetching = loader.epoch_wait
    # with prefetch a slow step hides the loading: the wait is well below the fetch time (the
    # first batch is still waited for: about a sixth of it)
    loader = get_data_loader(Slow(12, delay=0.01), 2, 1, 0, prefetch=2)
    for _ in loader:
        time.sleep(0.05)
    assert loader.steps == 6 and loader.epoch_wait < 0.5 * fetching, (loader.epoch_wait, fetching)
    assert loader.wait_share(1.0) == pytest.approx(loader.epoch_wait)


@pytest.mark.timeout(60)
def test_errors_and_breaks_leave_no_thread_behind():
    def prefetchers() -> list[threading.Thread]:  # the process's count moves with other threads
        return [t for t in threading.enumerate() if t.name == "fleetlike-prefetch"]

    before = prefetchers()
    loader = get_data_loader(Slow(20, bad=7), 2, 1, 0, shuffle=False, prefetch=3)
    with pytest.raises(ValueError, match="sample 7 is broken"):
        for _ in loader:
            pass
    loader = get_data_loader(Slow(20), 2, 1, 0, shuffle=False, prefetch=3)
    for i, _ in enumerate(loader):
        if i == 1:
            break
    assert [b[1].tolist() for b in loader][0] == [0, 1]  # a new pass starts the epoch over
    deadline = time.monotonic() + 10
    while prefetchers() != before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert prefetchers() == before
    with pytest.raises(ValueError, match="batch_size=0"):
        get_data_loader(indexed(4), 0, 1, 0)
    with pytest.raises(TypeError, match="no position to save"):
        get_data_loader(indexed(4), 2, 1, 0, sampler=torch.utils.data.SequentialSampler(range(4))).state_dict()


@pytest.mark.timeout(60)
def test_prefetch_thread_copies_on_the_loaders_gpu(monkeypatch):
    """A rank on GPU 1: the prefetch thread's copies, side stream and events run with GPU 1
    current (with GPU 0 current they land there, one context per rank of the node), and the
    training thread's stream waits for each copy's event. torch.cuda is replaced by recorders."""
    import contextlib

    import fleetlike.comm.cuda as cuda_mod
    import fleetlike.io.loader as loader_mod

    local, calls = threading.local(), []

    def note(what):
        calls.append((what, threading.current_thread().name, getattr(local, "device", 0)))

    class Stream:
        def __init__(self, device=None, **kw):
            note("stream")

        def wait_event(self, event):
            note(f"wait:{event.n}")

    class Event:
        made = 0

        def __init__(self, *a, **kw):
            Event.made += 1
            self.n = Event.made

        def record(self, stream=None):
            note(f"record:{self.n}")

    def set_device(index):
        local.device = int(getattr(index, "index", index))

    @contextlib.contextmanager
    def stream(s):
        note("stream-ctx")
        yield

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(cuda_mod, "_THREAD", threading.local())  # no thread has set a device yet
    monkeypatch.setattr(loader_mod, "_record_stream", lambda batch, s: None)
    monkeypatch.setattr(loader_mod, "to_device", lambda batch, device, non_blocking=False: (note("copy"), batch)[1])
    loader = get_data_loader(indexed(12), 4, 1, 0, shuffle=False, device="cuda:1", pin_memory=False, prefetch=2)
    assert [b[1].tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    helper = [c for c in calls if c[1] == "fleetlike-prefetch"]
    assert [c[0] for c in helper].count("copy") == 3 and {c[2] for c in helper} == {1}, helper
    waits = [c[0] for c in calls if c[1] == "MainThread" and c[0].startswith("wait:")]
    assert waits == [f"wait:{n}" for n in (1, 2, 3)], calls


# ------------------------------------------------------------------------ real ranks

N, B = 50, 4


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(1, 1)

    def forward(self, x):
        return self.lin(x)


def _train(role, ckpt, mode, stop):
    """Eager training over the loader; 'save' stops after ``stop`` batches and rank 0 saves,
    'load' restores and finishes the epoch, 'full' runs the epoch. Returns the labels seen."""
    fleet.init(role, timeout=30)
    model = fleet.distributed_model(Model())
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    loader = get_data_loader(indexed(N), B, seed=3, prefetch=2)
    fleet.register_state("loader", loader)
    if mode == "load":
        fleet.load_persistables(None, ckpt)
    loader.set_epoch(1)
    seen = []
    for step, (x, y) in enumerate(loader):
        opt.zero_grad()
        F.mse_loss(model(x), x).backward()
        opt.step()
        seen.append(y.tolist())
        if mode == "save" and step + 1 == stop:
            if role.rank == 0:
                fleet.save_persistables(None, ckpt)
                torch.save(loader.state_dict(), ckpt + ".loader")
            break
    return seen


def _resized(role, path):
    """A restart at another world size from a saved loader state: the rest of the epoch."""
    loader = get_data_loader(indexed(N), B, role.world_size, role.rank, seed=99, prefetch=1)
    loader.load_state_dict(torch.load(path))
    loader.set_epoch(1)
    return [y.tolist() for _, y in loader]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_resume_through_fleet_checkpoint_equals_the_uninterrupted_run(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    full = run_ranks(_train, 3, ckpt, "full", 0, timeout=60)
    first = run_ranks(_train, 3, ckpt, "save", 2, timeout=60)
    rest = run_ranks(_train, 3, ckpt, "load", 0, timeout=60)
    for r in range(3):
        assert first[r] + rest[r] == full[r], r
    # resize 3 -> 2: the samples not seen before the stop, each exactly once (no padding needed: 50 - 24 = 26)
    resized = run_ranks(_resized, 2, ckpt + ".loader", timeout=60)
    before = [i for r in first for b in r for i in b]
    after = [i for r in resized for b in r for i in b]
    assert len(before) == 2 * B * 3 and sorted(before + after) == list(range(N))
    assert len(resized[0]) == len(resized[1])


def _even_and_slow(role, style):
    """4 ranks, 2 nodes; 30 samples, batch 4, tail even (ranks 8/8/7/7 samples: 2 batches
    each); rank 2's samples are slow; the slow-rank report every 2 steps."""
    s = DistributedStrategy()
    s.slow_rank_check = True
    s.slow_rank_check_configs = {"every_n_steps": 2, "factor": 5.0}
    fleet.init(role, timeout=30, strategy=s)
    # 0.6 s a batch on rank 2: far past 5x the others' step even on a slow, loaded host (0.16 s
    # was hidden there: a CI-class host, 4 ranks on 2 cores, no rank read as slow)
    ds = Slow(30, delay=0.15 if role.rank == 2 else 0.0)
    loader = get_data_loader(ds, 4, tail="even", seed=1, prefetch=2)
    model = Model()
    reports, seen = [], []
    if style == "eager":
        model = fleet.distributed_model(model)
        opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    else:
        opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
        opt.minimize(lambda m, feed: F.mse_loss(m(feed["x"]), feed["x"]), model)
        Executor().run(fleet.startup_program)
    for epoch in range(2):
        loader.set_epoch(epoch)
        for x, y in loader:
            seen.append((epoch, y.tolist()))
            if style == "eager":
                opt.zero_grad()
                F.mse_loss(model(x), x).backward()
                opt.step()
                info = opt.step_info
            else:
                info = fleet.main_program.run({"x": x}).info
            if "slow_ranks" in info:
                reports.append(([(r, h) for r, h, _ in info["slow_ranks"]], info["data_wait"]))
    return seen, reports


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("style", ["eager", pytest.param("program", marks=pytest.mark.slow)])
def test_even_tail_and_a_slow_input_pipeline_named_by_the_report(style):
    results = run_ranks(_even_and_slow, 4, style, nodes=2, timeout=90)
    for epoch in range(2):
        per_rank = [[b for e, b in seen if e == epoch] for seen, _ in results]
        assert {len(b) for b in per_rank} == {2}  # every rank the same number of batches
        flat = [i for b in per_rank for batch in b for i in batch]
        assert sorted(flat) == list(range(30))  # 30 over 4: nothing repeated, nothing dropped
    for _, reports in results:
        assert len(reports) == 2  # 4 steps, a report every 2
        for slow, waits in reports:
            assert slow == [(2, "127.0.0.2")]
            assert waits[2] >= 0.02 and waits[2] > 5 * max(waits[0], waits[1], waits[3])

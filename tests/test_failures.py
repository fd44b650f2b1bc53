"""Never hang, never corrupt silently: real processes, each test <= 60 s, nothing left running."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from dp_common import batch, loss_fn, make_model
from fleetlike import DistributedStrategy, Executor, fleet
from fleetlike.comm import CommError
from fleetlike.testing import RankError, hosted_job, preloaded_context, run_ranks


def _catch(fn):
    try:
        return "ok", fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects the message
        return type(exc).__name__, str(exc)


def _sleepy(role, sleeper, gave_up):
    """The sleeper stays away from all-reduce #2 until every other rank has given up on it
    (each writes a file in ``gave_up``), however long their 2 s timeout takes to fire."""
    fleet.init(role, timeout=2.0)
    world = fleet._ctx.world
    world.all_reduce(torch.ones(3))  # #1: everyone is here
    if role.rank == sleeper:
        others = [os.path.join(gave_up, str(r)) for r in range(role.world_size) if r != sleeper]
        while not all(os.path.exists(p) for p in others):
            time.sleep(0.02)
    result = _catch(lambda: world.all_reduce(torch.ones(3)))
    open(os.path.join(gave_up, str(role.rank)), "w").close()
    return result


@pytest.mark.timeout(60)
def test_a_sleeping_rank_times_out_everyone_else_naming_it(tmp_path):
    results = run_ranks(_sleepy, 3, 1, str(tmp_path), timeout=45)
    for rank in (0, 2):
        kind, msg = results[rank]
        assert kind == "CollectiveTimeoutError", msg
        assert "all_reduce #2" in msg and "ranks [1] did not arrive" in msg and "2s timeout" in msg


def _one_gives_up(role, waiting):
    if role.rank == 0:
        while not os.path.exists(waiting):  # rank 1 is inside _waiting_for_a_peer
            time.sleep(0.01)
        raise ValueError("rank 0 gives up")
    _waiting_for_a_peer(waiting)


def _waiting_for_a_peer(waiting):
    open(waiting, "w").close()
    time.sleep(60)


@pytest.mark.timeout(60)
def test_a_failed_world_reports_where_the_other_ranks_were(tmp_path):
    started = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(_one_gives_up, 2, str(tmp_path / "waiting"), timeout=45)
    msg = str(info.value)
    assert "rank 0 raised" in msg and "rank 0 gives up" in msg
    assert "rank 1 was still running, at:" in msg and "_waiting_for_a_peer" in msg, msg
    assert time.monotonic() - started < 30  # the error does not wait for the sleeper


def _killed(role, victim):
    fleet.init(role, timeout=30.0)
    world = fleet._ctx.world
    world.all_reduce(torch.ones(3))
    big = torch.ones(32 << 20)
    if role.rank == victim:
        world.all_reduce_async(big)  # in flight when the process dies
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    kind, msg = _catch(lambda: world.all_reduce(big))
    return kind, msg, time.monotonic() - started


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_rank_killed_inside_an_all_reduce_fails_the_others_fast():
    results = run_ranks(_killed, 3, 2, timeout=45, may_die=[2])
    assert results[2] is None
    for kind, msg, took in results[:2]:
        assert kind == "CollectiveFailedError", msg
        assert "all_reduce #2" in msg and "did not arrive" in msg
        # the dead rank is always named; a live peer that had not noticed yet within the grace
        # period may be named too (the report is what each rank could see)
        missing = msg.split("ranks ")[1].split(" did not arrive")[0]
        assert "2" in missing
        assert took < 20  # well within the 30 s timeout: dead peers are noticed, not waited out


def _mismatch(role, what):
    if what == "op":  # the environment switch, for debugging a script without editing it
        os.environ["FLEETLIKE_CHECK_COLLECTIVES"] = "1"
    fleet.init(role, timeout=20.0, check_collectives=what == "shape")
    world = fleet._ctx.world
    if what == "shape":
        t = torch.ones(4 if role.rank == 0 else 5)
        return _catch(lambda: world.all_reduce(t))
    return _catch(lambda: world.all_reduce(torch.ones(4), "sum" if role.rank == 0 else "max"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what", ["shape", "op"])
def test_desync_check_raises_on_every_rank_with_a_table(what):
    results = run_ranks(_mismatch, 2, what, timeout=40)
    for kind, msg in results:
        assert kind == "CollectiveMismatchError", msg
        assert "disagree on collective #1" in msg
        assert "rank  seq  op" in msg
        if what == "shape":
            assert "(4,)" in msg and "(5,)" in msg
        else:
            assert " sum " in msg and " max " in msg
    assert results[0][1] == results[1][1]  # the same table everywhere


def _nan(role):
    fleet.init(role, timeout=20.0)
    model = make_model(100)
    s = DistributedStrategy()
    s.check_nan_inf = True
    fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), s).minimize(
        lambda m, f: loss_fn(m, f) * f["scale"], model
    )
    exe = Executor()
    exe.run(fleet.startup_program)
    exe.run(fleet.main_program, feed={**batch(0, role.rank), "scale": torch.tensor(1.0)})
    scale = torch.tensor(float("nan") if role.rank == 1 else 1.0)
    result = _catch(lambda: exe.run(fleet.main_program, feed={**batch(1, role.rank), "scale": scale}))
    if role.rank == 1:
        fleet.shutdown()  # rank 1 stops: its peers must not hang waiting for it
    return result


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_nan_on_one_rank_every_rank_raises_naming_the_parameter_and_rank():
    results = run_ranks(_nan, 2, timeout=45)
    kind, msg = results[1]
    assert kind == "FloatingPointError", msg
    # the loss is NaN there: all 4 gradients, the first in bucket order (the reverse of the model's) named
    assert msg.startswith("the gradients of rank 1 (2.bias and 3 more) held NaN or Inf"), msg
    assert results[0] == results[1]  # every rank raises the same error at that step, none waits for rank 1


def _job(role, rounds, up=None, stop=None):
    """``rounds`` all-reduces of rank + 1; with ``up`` and ``stop`` (paths), rank 0 writes ``up``
    after the first, and the ranks go on until one of them sees ``stop`` (they agree through the
    sum), for at most 30 s."""
    from pathlib import Path

    try:
        fleet.init(role, timeout=20.0)
    except CommError as exc:
        return type(exc).__name__, str(exc)
    world = fleet._ctx.world
    total, done, deadline = 0.0, 0, time.monotonic() + 30
    while done < rounds or stop is not None:
        stopping = float(stop is not None and Path(stop).exists())
        total, stopped = world.all_reduce(torch.tensor([float(role.rank + 1), stopping])).tolist()
        done += 1
        if up is not None and role.rank == 0 and done == 1:
            Path(up).write_text("up")
        if stop is not None and (stopped or time.monotonic() > deadline):
            return ("ok" if stopped else "never stopped"), total
        time.sleep(0.05)
    return "ok", total


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_two_jobs_on_the_same_ports_never_join(tmp_path):
    first: dict = {}
    up, stop = tmp_path / "up", tmp_path / "stop"
    with hosted_job(1, 2, job_id="jobA") as job_a:  # job A's store and ports, held by this test
        t = threading.Thread(target=lambda: first.update(
            r=run_ranks(_job, job=job_a, rounds=1, up=str(up), stop=str(stop), timeout=40)))
        t.start()
        try:
            deadline = time.monotonic() + 30
            while not up.exists() and t.is_alive() and time.monotonic() < deadline:
                time.sleep(0.02)  # job A is up: its first all-reduce is done
            assert up.exists(), "job A did not start"
            # job B is told job A's endpoints on purpose: its rank 0 tries to host the store there
            second = run_ranks(_job, endpoints=job_a.endpoints, job_id="jobB", rounds=1, timeout=40)
        finally:
            stop.write_text("stop")  # job A has all-reduced all along; now it ends
            t.join()
    assert first["r"] == [("ok", 3.0), ("ok", 3.0)]  # job A is unaffected
    kind0, msg0 = second[0]
    assert kind0 == "RendezvousError" and "cannot host the rendezvous store" in msg0
    kind1, msg1 = second[1]
    # job B's rank 1 reaches job A's store without job A's secret: refused before it learns more
    assert kind1 == "SecretMismatchError" and "'jobB'" in msg1 and "does not hold this job's secret" in msg1


def _launch(tmp_path, mode):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "launch_workers" / "collective_fail.py"
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "fleetlike.launch", "--nproc_per_node=3", "--started_port=auto",
         "--log_dir", str(tmp_path / "log"), str(script), mode],
        capture_output=True, text=True, timeout=50, cwd=tmp_path,
    )
    return proc, time.monotonic() - started


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_under_the_launcher_a_timeout_ends_the_job_with_the_message(tmp_path):
    proc, took = _launch(tmp_path, "sleep")
    assert proc.returncode != 0 and took < 30
    summary = proc.stderr.strip().splitlines()[-1]
    assert "CollectiveTimeoutError: all_reduce #2" in summary and "ranks [1] did not arrive" in summary
    log = (tmp_path / "log" / f"workerlog.{summary.split('rank ')[1].split()[0]}").read_text()
    assert "CollectiveTimeoutError" in log


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_under_the_launcher_a_killed_rank_ends_the_job_within_10s(tmp_path):
    proc, took = _launch(tmp_path, "kill")
    assert proc.returncode != 0
    assert took < 10 + 3  # the job's end, plus interpreter start-up of the launcher and workers
    assert "rank 1 (local 1) was killed by signal SIGKILL" in proc.stderr


def _saver(role, ckpt, ready):
    from pathlib import Path

    fleet.init(role, timeout=30)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(24)])  # ~25 MB
    fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1)).minimize(
        lambda m, f: m(f).sum(), model
    )
    exe = Executor()
    version = 0
    while True:  # keep saving new versions until the test kills us mid-save
        version += 1
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(version))
        fleet.save_persistables(exe, ckpt)
        Path(ready).write_text(str(version))


def _loader(role, ckpt):
    fleet.init(role, timeout=30)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(24)])
    fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1)).minimize(
        lambda m, f: m(f).sum(), model
    )
    fleet.load_persistables(Executor(), ckpt)
    values = {float(v) for p in model.parameters() for v in p.detach().unique()}
    return values


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_kill_during_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    from pathlib import Path

    from fleetlike.roles import Role

    ckpt, ready = str(tmp_path / "ckpt"), tmp_path / "ready"
    role = Role.from_endpoints(0, ["127.0.0.1:6170"])  # a world of one binds no port
    proc = preloaded_context().Process(target=_saver, args=(role, ckpt, str(ready)))
    proc.start()
    try:
        deadline = time.monotonic() + 40
        while not (ready.exists() and int(ready.read_text() or 0) >= 2) and time.monotonic() < deadline:
            time.sleep(0.01)
        # wait until a save is in progress: its temporary directory exists
        while not list(Path(tmp_path).glob(".ckpt.tmp-*")) and time.monotonic() < deadline:
            time.sleep(0.001)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.join(10)
    assert proc.exitcode == -signal.SIGKILL
    assert list(Path(tmp_path).glob(".ckpt.tmp-*"))  # the kill did land inside a save
    (values,) = run_ranks(_loader, 1, ckpt, timeout=30)
    assert len(values) == 1 and values.pop() >= 1.0  # one complete version, not a mixture


def _slow(role):
    fleet.init(role, timeout=30)
    model = make_model(100)
    s = DistributedStrategy()
    s.slow_rank_check = True
    # factor 10: the healthy ranks' own work is ~1 ms per step, so at 1.5 a scheduling hiccup on
    # 2 cores (4 ranks) reported a healthy rank (1.61x the median); and rank 2's pause is long
    # enough that a busy machine, where a healthy step can take 10-20 ms, never hides it
    s.slow_rank_check_configs = {"every_n_steps": 4, "factor": 10.0}

    def lf(m, feed):
        if role.rank == 2:
            time.sleep(0.4)  # this rank's data loading is slow: ~400x the others
        return loss_fn(m, feed)

    fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), s).minimize(lf, model)
    exe = Executor()
    exe.run(fleet.startup_program)
    reports = []
    for step in range(9):
        state = fleet.main_program.run(batch(step, role.rank))
        if "slow_ranks" in state.info:
            reports.append(state.info["slow_ranks"])
    return reports


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_slow_rank_is_reported_by_rank_and_host():
    results = run_ranks(_slow, 4, nodes=2, timeout=45)
    for reports in results:
        assert len(reports) == 2  # steps 4 and 8
        for slow in reports:
            assert [(r, host) for r, host, _ in slow] == [(2, "127.0.0.2")]
            assert slow[0][2] >= 0.4


def _fit(role, ckpt, phase):
    fleet.init(role, timeout=30)
    model = make_model(1)
    s = DistributedStrategy()
    if phase == "load":
        s.nccl_comm_num = 2
    fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), s).minimize(loss_fn, model)
    if phase == "save":
        if role.rank == 0:
            fleet.save_persistables(Executor(), ckpt)
        return "saved"
    return _catch(lambda: fleet.load_persistables(Executor(), ckpt))


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_loading_checks_the_strategy_not_the_world_size(tmp_path):
    # a checkpoint loads at another world size (state is replicated or resharded)
    ckpt = str(tmp_path / "c")
    run_ranks(_fit, 2, ckpt, "save", timeout=30)
    kind, msg = run_ranks(_fit, 1, ckpt, "load", timeout=30)[0]
    assert kind == "CheckpointError"
    assert "world size" not in msg and "strategy.nccl_comm_num: saved 1, now 2" in msg


def test_rendezvous_names_the_store_the_wait_and_the_missing_ranks():
    from fleetlike.comm import RendezvousError, create_world

    with hosted_job(1, 3, job_id="lonely") as job, pytest.raises(RendezvousError) as info:
        eps = job.endpoints
        started = time.monotonic()
        create_world(job.role(0), timeout=1.5)  # ranks 1 and 2 never start
    msg = str(info.value)
    assert eps[0] in msg and "ranks [1, 2] of 3 did not arrive" in msg and "waited" in msg
    assert time.monotonic() - started < 10

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
from fleetlike.testing import endpoints_for, run_ranks


def _catch(fn):
    try:
        return "ok", fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects the message
        return type(exc).__name__, str(exc)


def _sleepy(role, sleeper, nap):
    fleet.init(role, timeout=2.0)
    world = fleet._ctx.world
    world.all_reduce(torch.ones(3))  # #1: everyone is here
    if role.rank == sleeper:
        time.sleep(nap)
    return _catch(lambda: world.all_reduce(torch.ones(3)))


@pytest.mark.timeout(60)
def test_a_sleeping_rank_times_out_everyone_else_naming_it():
    results = run_ranks(_sleepy, 3, 1, 8.0, timeout=45)
    for rank in (0, 2):
        kind, msg = results[rank]
        assert kind == "CollectiveTimeoutError", msg
        assert "all_reduce #2" in msg and "ranks [1] did not arrive" in msg and "2s timeout" in msg


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


@pytest.mark.timeout(60)
def test_a_rank_killed_inside_an_all_reduce_fails_the_others_fast():
    results = run_ranks(_killed, 3, 2, timeout=45, may_die=[2])
    assert results[2] is None
    for kind, msg, took in results[:2]:
        assert kind == "CollectiveFailedError", msg
        assert "all_reduce #2" in msg and "ranks [2] did not arrive" in msg
        assert took < 10


def _mismatch(role, what):
    fleet.init(role, timeout=20.0, check_collectives=True)
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


@pytest.mark.timeout(60)
def test_nan_on_one_rank_names_the_parameter_and_rank():
    results = run_ranks(_nan, 2, timeout=45)
    kind, msg = results[1]
    assert kind == "FloatingPointError", msg
    assert msg.startswith("rank 1: the gradient of ") and ".weight" in msg and "NaN or Inf" in msg
    assert results[0][0] in ("CollectiveFailedError", "CollectiveTimeoutError"), results[0]


def _job(role, rounds):
    try:
        fleet.init(role, timeout=20.0)
    except CommError as exc:
        return type(exc).__name__, str(exc)
    world = fleet._ctx.world
    total = 0.0
    for _ in range(rounds):
        total = world.all_reduce(torch.tensor([float(role.rank + 1)])).item()
        time.sleep(0.2)
    return "ok", total


@pytest.mark.timeout(60)
def test_two_jobs_on_the_same_ports_never_join():
    eps = endpoints_for(1, 2)
    first: dict = {}
    t = threading.Thread(target=lambda: first.update(r=run_ranks(_job, endpoints=eps, job_id="jobA", rounds=40, timeout=40)))
    t.start()
    time.sleep(2.5)  # job A is up and holds the port (it runs ~8 s)
    second = run_ranks(_job, endpoints=eps, job_id="jobB", rounds=1, timeout=40)
    t.join()
    assert first["r"] == [("ok", 3.0), ("ok", 3.0)]  # job A is unaffected
    kind0, msg0 = second[0]
    assert kind0 == "RendezvousError" and "cannot host the rendezvous store" in msg0
    kind1, msg1 = second[1]
    assert kind1 == "JobMismatchError" and "'jobB'" in msg1 and "'jobA'" in msg1

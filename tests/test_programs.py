"""Programs: alternating main and origin, printouts, executor fetches, save/load resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dp_common import batch, loss_fn, make_model, make_opt, max_diff, params
from fleetlike import DistributedStrategy, Executor, fleet
from fleetlike.program import Op, Program
from fleetlike.testing import run_ranks


def _local_grads(model, feed):
    grads = torch.autograd.grad(loss_fn(model, feed), list(model.parameters()))
    return [g.detach().clone() for g in grads]


def _alternate(role):
    with fleet.session(role, timeout=30):
        model = make_model(100 + role.rank)
        opt = make_opt("sgd", model)
        fleet.distributed_optimizer(opt, DistributedStrategy()).minimize(loss_fn, model)
        exe = Executor()
        exe.run(fleet.startup_program)
        world = fleet._ctx.world
        checks = []
        for step in range(6):
            feed = batch(step, role.rank)
            before = [p.detach().clone() for p in model.parameters()]
            local = _local_grads(model, feed)
            gathered = fleet.util.all_gather(torch.cat([g.reshape(-1) for g in local]))
            mean = torch.stack(gathered).mean(0)
            calls = world.stats.total_calls
            main = step % 2 == 0
            run, = exe.run(fleet.main_program if main else fleet._origin_program, feed=feed,
                           fetch_list=["collectives"] if main else ["loss"])
            if main:  # the step's own record agrees with the communicator's count
                assert run == world.stats.total_calls - calls
            used = torch.cat([g.reshape(-1) for g in local]) if not main else mean
            delta = torch.cat([(p.detach() - b).reshape(-1) for p, b in zip(model.parameters(), before)])
            checks.append((main, float((delta + 0.1 * used).abs().max()), world.stats.total_calls - calls))
        return checks, str(fleet.main_program), str(fleet._origin_program), params(model)


@pytest.mark.timeout(90)
def test_alternating_main_and_origin():
    results = run_ranks(_alternate, 2, timeout=60)
    for checks, main_txt, origin_txt, _ in results:
        for is_main, err, calls in checks:
            assert err <= 1e-6  # main: update by the rank-averaged gradient; origin: by the local one
            # main: one fused bucket (the default 32 MB holds this model); origin: nothing at all
            assert calls == (1 if is_main else 0)
        assert "c_allreduce_avg" in main_txt and "c_wait_allreduce" in main_txt
        assert "c_allreduce" not in origin_txt and "optimizer_update" in origin_txt
    # after an origin step ranks differ; the printed programs are identical on both ranks
    assert max_diff(results[0][3], results[1][3]) > 1e-4
    assert results[0][1] == results[1][1]


def _train_with_checkpoint(role, opt_name, ckpt, phase):
    with fleet.session(role, timeout=30):
        model = make_model(100 + role.rank)
        opt = make_opt(opt_name, model)
        fleet.distributed_optimizer(opt, DistributedStrategy()).minimize(loss_fn, model)
        exe = Executor()
        exe.run(fleet.startup_program)
        if phase == "resume":
            fleet.load_persistables(exe, ckpt)
            steps = range(5, 10)
        else:
            steps = range(10)
        for step in steps:
            if phase == "full" and step == 5:
                if fleet.is_first_worker():
                    fleet.save_persistables(exe, ckpt)
                fleet.barrier_worker()
            exe.run(fleet.main_program, feed=batch(step, role.rank))
        return params(model), fleet.main_program.runs


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("opt_name", [pytest.param("momentum", marks=pytest.mark.slow), "adam"])
def test_save_load_resume_is_exact(tmp_path, opt_name):
    ckpt = str(tmp_path / "ckpt")
    full = run_ranks(_train_with_checkpoint, 2, opt_name, ckpt, "full", timeout=60)
    resumed = run_ranks(_train_with_checkpoint, 2, opt_name, ckpt, "resume", timeout=60)
    for (a, runs_a), (b, runs_b) in zip(full, resumed):
        assert max_diff(a, b) == 0.0
        assert runs_a == runs_b == 10


def test_program_editing_and_printing():
    calls = []
    prog = Program("p", [Op("forward", lambda s: calls.append("f")), Op("optimizer_update", lambda s: calls.append("u"))])
    clone = prog.clone("q")
    clone.insert_before("optimizer_update", Op("c_allreduce_sum", lambda s: calls.append("c"), {"bucket": 0}))
    clone.insert_after("c_allreduce_sum", Op("note", None, {"k": lambda: 4}, parent="c_allreduce_sum"))
    prog.run()
    clone.run()
    assert calls == ["f", "u", "f", "c", "u"]
    assert [o.type for o in prog] == ["forward", "optimizer_update"]  # the original is untouched
    text = str(clone)
    assert "c_allreduce_sum bucket=0" in text and "k=4" in text and "(during c_allreduce_sum)" in text
    with pytest.raises(KeyError, match="no op 'backward'"):
        prog.index("backward")


def test_single_process_fleet_and_fetch(tmp_path):
    from fleetlike.roles import UserDefinedRoleMaker

    with fleet.session(UserDefinedRoleMaker(0, ["127.0.0.1:6170"])):
        model = make_model(1)
        opt = make_opt("sgd", model)

        def lf(m, feed):
            out = m(feed["x"])
            return {"loss": torch.nn.functional.cross_entropy(out, feed["y"]), "logits": out}

        main, startup = fleet.distributed_optimizer(opt).minimize(lf, model)
        assert main is fleet.main_program and startup is fleet.startup_program
        exe = Executor()
        exe.run(startup)
        loss, logits = exe.run(main, feed={k: v.numpy() for k, v in batch(0, 0).items()}, fetch_list=["loss", "logits"])
        assert isinstance(loss, float) and isinstance(logits, np.ndarray) and logits.shape == (8, 3)
        with pytest.raises(KeyError, match="'nope'"):
            exe.run(main, feed=batch(0, 0), fetch_list=["nope"])
        with pytest.raises(TypeError, match="Program"):
            exe.run("main")
        fleet.save_inference_model(exe, str(tmp_path / "inf"), ["x"], ["logits"])
        from fleetlike import load_inference_model

        with pytest.raises(ValueError, match="model.pt is a pickled module: loading it runs code"):
            load_inference_model(str(tmp_path / "inf"))  # the pickle only on request
        x = batch(0, 0)["x"]
        loaded, feeds, targets = load_inference_model(str(tmp_path / "inf"), weights_only=False)
        assert feeds == ["x"] and targets == ["logits"]
        assert torch.allclose(loaded(x), model(x))
        filled, _, _ = load_inference_model(str(tmp_path / "inf"), model=make_model(5))  # weights only
        assert torch.equal(filled(x), model(x)) and not filled.training
        assert [e.name for e in fleet.applied_strategy()][0] == "data_parallel"
        assert fleet.util.get_file_shard(list("abcde")) == list("abcde")
        assert fleet.util.all_reduce(3, "sum") == 3 and fleet.util.all_reduce(2.5, "max") == 2.5


def test_errors_name_the_fix():
    fleet.shutdown()
    with pytest.raises(RuntimeError, match="fleet.init"):
        fleet.distributed_optimizer(torch.optim.SGD(make_model(0).parameters(), lr=0.1))
    with pytest.raises(ValueError, match="parameter-server"):
        fleet.init(is_collective=False)
    with pytest.raises(RuntimeError, match="minimize"):
        fleet.main_program


def test_save_refuses_to_replace_a_foreign_directory(tmp_path):
    from fleetlike.fleet.checkpoint import CheckpointError, atomic_dir

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="not a fleetlike checkpoint"):
        with atomic_dir(tmp_path / "mine"):
            pass
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def _bcast(role):
    from fleetlike.collectives import broadcast_coalesced
    from fleetlike.testing import make_world

    world = make_world(role)
    try:
        g = torch.Generator().manual_seed(role.rank)
        tensors = [torch.randn(n, generator=g) for n in (3, 40, 7, 100)] + [torch.arange(5) * (role.rank + 1)]
        broadcast_coalesced(world, tensors, cap_bytes=64)  # chunks of <= 16 floats; big ones alone
        return [t.tolist() for t in tensors], world.stats.calls["broadcast"]
    finally:
        world.close()


@pytest.mark.timeout(60)
def test_broadcast_coalesced_chunks_and_matches_rank0():
    (a, calls), (b, _) = run_ranks(_bcast, 2, timeout=30)
    assert a == b
    g = torch.Generator().manual_seed(0)
    assert a[:4] == [torch.randn(n, generator=g).tolist() for n in (3, 40, 7, 100)]
    assert calls == 4  # [3, 7] packed; 40 and 100 alone; the int64 tensor in its own pack


def test_strategy_override_from_the_environment(monkeypatch):
    from fleetlike.roles import UserDefinedRoleMaker

    monkeypatch.setenv("FLEETLIKE_STRATEGY", '{"fuse_all_reduce_ops": false, "find_unused_parameters": true}')
    with fleet.session(UserDefinedRoleMaker(0, ["127.0.0.1:6170"])):
        opt = fleet.distributed_optimizer(torch.optim.SGD(make_model(0).parameters(), lr=0.1), DistributedStrategy())
        assert opt.user_defined_strategy.fuse_all_reduce_ops is False
        assert opt.user_defined_strategy.find_unused_parameters is True
        monkeypatch.setenv("FLEETLIKE_STRATEGY", '{"nccl_comm_nun": 2}')
        with pytest.raises(KeyError, match="nccl_comm_num"):
            fleet.distributed_optimizer(torch.optim.SGD(make_model(0).parameters(), lr=0.1))

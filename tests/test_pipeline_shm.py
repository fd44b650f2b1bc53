"""A pipeline's handoffs through shared memory (``pipeline_configs.p2p = "auto"``): the
``fleetlike_shm`` backend's rings (`fleetlike.comm.shm`, `fleetlike.comm.torch_shm`).

The rings move bytes, so the pipeline over them must equal torch's own schedule over a plain
gloo group bit for bit; the backend keeps torch's point-to-point semantics (receives matched in
order, any dtype and layout, messages longer than the ring, out-of-order waits); an aborting
rank wakes its peer with an error.
"""

from __future__ import annotations

import gc
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

import pipeline_common as pc
from fleetlike.comm.shm import Ring, RingClosedError, shm_unsupported
from fleetlike.testing import run_ranks

pytestmark = [pytest.mark.alone,
              pytest.mark.skipif(shm_unsupported() is not None, reason=str(shm_unsupported()))]


def _path(name: str) -> str:
    return f"/dev/shm/fleetlike-test-{os.getpid()}-{name}"


def test_ring_carries_bytes_in_order_wrapping_and_streaming():
    writer = Ring.create(_path("a"), 4096)
    reader = Ring.open(writer.path)
    reader.unlink()
    deadline = time.monotonic() + 30
    try:
        for i in range(300):  # messages of odd sizes wrap around the 4 KiB ring
            sent = torch.arange(i % 53 + 1, dtype=torch.float64) * i
            writer.send(sent.data_ptr(), sent.nbytes, 5, deadline)
            got = torch.empty_like(sent)
            reader.recv(got.data_ptr(), got.nbytes, 5, deadline)
            assert torch.equal(got, sent), i
        big = torch.randn(100_000)  # 400 KB through 4 KiB: streams as the reader frees space
        sender = threading.Thread(target=writer.send, args=(big.data_ptr(), big.nbytes, 1, deadline))
        sender.start()
        got = torch.empty_like(big)
        reader.recv(got.data_ptr(), got.nbytes, 1, deadline)
        sender.join()
        assert torch.equal(got, big)
        three = torch.ones(3)
        writer.send(three.data_ptr(), three.nbytes, 2, deadline)
        four = torch.empty(4)
        with pytest.raises(RuntimeError, match="12 bytes with tag 2, but the receive posted is 16 bytes with tag 2"):
            reader.recv(four.data_ptr(), four.nbytes, 2, deadline)
    finally:
        writer.close()
        reader.close()


def test_a_closed_ring_wakes_its_waiter_with_the_reason():
    writer = Ring.create(_path("b"), 4096)
    reader = Ring.open(writer.path)
    reader.unlink()
    try:
        four = torch.empty(4)
        threading.Timer(0.2, writer.close_link).start()
        start = time.monotonic()
        with pytest.raises(RingClosedError, match="aborted its links"):
            reader.recv(four.data_ptr(), four.nbytes, 0, time.monotonic() + 30)
        assert time.monotonic() - start < 5
    finally:
        writer.close()
        reader.close()


def _semantics(role):
    """torch's point-to-point calls on a ``fleetlike_shm`` group against the same on gloo."""
    from fleetlike.comm import create_world
    from fleetlike.comm.torch_group import release_torch_group, torch_process_group
    from fleetlike.comm.torch_shm import BACKEND, register

    world = create_world(role)
    torch_process_group(world, torch.device("cpu"), purpose="a test")
    register()
    shm = dist.new_group([0, 1], backend=BACKEND)
    me, other = role.rank, 1 - role.rank
    g = torch.Generator().manual_seed(7)
    msgs = [torch.randn(5, 3, generator=g).t(),  # not contiguous
            torch.randint(0, 1000, (7,), generator=g, dtype=torch.int64),
            torch.randn(3, generator=g).to(torch.bfloat16), torch.tensor(True), torch.empty(0),
            torch.randn(1_500_000, generator=g)]  # 6 MB: longer than the ring, streams
    out: dict[str, object] = {"local": sorted(shm.local)}
    if me == 0:
        works = [dist.isend(t, group=shm, group_dst=other) for t in msgs]
        for w in works:
            w.wait()
        fused = torch.arange(4.0)
        back = torch.empty(4)
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, fused, other, shm),
                                         dist.P2POp(dist.irecv, back, other, shm)]):
            w.wait()
        out["back"] = torch.equal(back, fused * 2)
        objs = [{"a": 1, "b": [2, 3]}]
        dist.send_object_list(objs, group_dst=other, group=shm)
    else:
        bufs = [torch.empty_like(t) for t in msgs]
        bufs[0] = torch.empty(5, 3).t()  # receive into a non-contiguous tensor too
        works = [dist.irecv(b, group=shm, group_src=other) for b in bufs]
        for w in reversed(works):  # waited last first: the earlier receives complete in order
            w.wait()
        out["equal"] = [torch.equal(b, t) for b, t in zip(bufs, msgs)]
        got = torch.empty(4)
        dist.irecv(got, group=shm, group_src=other).wait()
        dist.isend(got * 2, group=shm, group_dst=other).wait()
        objs = [None]
        dist.recv_object_list(objs, group_src=other, group=shm)
        out["objs"] = objs[0]
    loss = torch.tensor(float(me + 1))
    dist.broadcast(loss, group_src=1, group=shm)  # collectives ride gloo
    out["loss"] = float(loss)
    gathered: list[object] = [None, None]
    dist.all_gather_object(gathered, me * 10, group=shm)
    out["gathered"] = gathered
    release_torch_group(world)
    world.close()
    return out


def test_point_to_point_keeps_torchs_semantics():
    r0, r1 = run_ranks(_semantics, 2, timeout=60)
    assert r0["local"] == [1] and r1["local"] == [0]
    assert r1["equal"] == [True] * 6, r1["equal"]
    assert r0["back"] and r1["objs"] == {"a": 1, "b": [2, 3]}
    assert r0["loss"] == r1["loss"] == 2.0 and r0["gathered"] == r1["gathered"] == [0, 10]


def _pipeline_vs_torch_on_gloo(role, mode, p2p):
    """fleetlike's pipeline (handoffs per ``p2p``) and torch's schedule on a plain gloo group."""
    from fleetlike import fleet

    s = pc.strategy(mode, 2, 1)
    s.pipeline_configs["p2p"] = p2p
    fleet.init(role, strategy=s)
    try:
        model, _, losses = pc.train_pipeline(s, "adamw")
        got = fleet.full_state_dict(model)
        hcg = fleet.get_hybrid_communicate_group()
        applied = [str(e) for e in fleet.applied_strategy()]
        applied.append(f"frozen {gc.get_freeze_count()}")
        # the training step sends and receives through the ring backend itself on shared memory
        kind = (type(hcg.get_pipe_parallel_process_group()).__name__, type(model.runner.link.direct).__name__)
        plain = dist.new_group([0, 1])  # gloo, as torch's default
        hcg._pipe_group, shared = plain, hcg._pipe_group
        want = pc.torch_schedule(hcg, mode, "adamw", [None, None])
        hcg._pipe_group = shared
    finally:
        fleet.shutdown()
    return got, want, losses, applied, kind


@pytest.mark.parametrize("mode", ["1F1B", "FThenB"])
def test_pipeline_over_shared_memory_equals_torchs_schedule_over_gloo_bit_for_bit(mode):
    for got, want, losses, applied, kind in run_ranks(_pipeline_vs_torch_on_gloo, 2, mode, "auto", timeout=90):
        assert kind == ("ShmProcessGroup", "ShmProcessGroup"), kind
        assert any("handoffs: shared memory with its neighbour" in a for a in applied), applied
        # after the first step the heap is frozen out of the collector (a full collection stalls a stage)
        assert any(a.startswith("pipeline_gc: applied") for a in applied), applied
        assert int(applied[-1].split()[1]) > 10_000, applied[-1]
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
        assert len(losses) == pc.STEPS


def test_p2p_gloo_keeps_the_handoffs_on_gloo():
    for got, want, _, applied, kind in run_ranks(_pipeline_vs_torch_on_gloo, 2, "1F1B", "gloo", timeout=90):
        assert kind[0] != "ShmProcessGroup" and kind[1] == "NoneType", kind
        assert any("handoffs: gloo (pipeline_configs.p2p='gloo')" in a for a in applied), applied
        assert all(torch.equal(got[k], want[k]) for k in want)


def _freeze_counts(role, freeze, style):
    """The objects gc.freeze holds before and after two pipelined steps (eager ``train_batch``, or
    the program style's ``exe.run``), and the pipeline_gc line."""
    import torch.nn.functional as F

    import fleetlike
    from fleetlike import fleet

    s = pc.strategy("1F1B", 2, 1)
    s.pipeline_configs["freeze_heap"] = freeze
    fleet.init(role, strategy=s)
    try:
        before = gc.get_freeze_count()
        if style == "eager":
            pc.train_pipeline(s, "momentum", steps=2)
        else:
            model = fleet.distributed_model(pc.make_net())
            opt = fleet.distributed_optimizer(pc.make_opt("momentum", model.parameters()))
            opt.minimize(F.cross_entropy, model)
            exe = fleetlike.Executor(fleet.device())
            exe.run(fleet.startup_program)
            for step in range(2):
                x, y = pc.my_batch(step, 0, 1)
                exe.run(fleet.main_program, feed={"x": x, "y": y}, fetch_list=["loss"])
        after = gc.get_freeze_count()
        line = [str(e) for e in fleet.applied_strategy() if e.name == "pipeline_gc"]
    finally:
        fleet.shutdown()
    return before, after, line


@pytest.mark.parametrize("style", ["eager", "program"])
def test_freeze_heap_false_leaves_the_collector_alone(style):
    """pipeline_configs.freeze_heap: True freezes what the first step left alive (the count grows
    by the model, its optimizer state, the schedule's), False freezes nothing; in both styles."""
    for before, after, line in run_ranks(_freeze_counts, 2, False, style, timeout=60):
        assert after <= before, (before, after)  # frozen objects freed meanwhile leave the count
        assert line and line[0].startswith("pipeline_gc: NOT applied (pipeline_configs.freeze_heap=False"), line
    for before, after, line in run_ranks(_freeze_counts, 2, True, style, timeout=60):
        assert after > before + 1000, (before, after)
        assert line and line[0].startswith("pipeline_gc: applied"), line


class _FirstForwardRaises(torch.nn.Module):
    """Raises in rank 0's first forward: before that stage has sent anything."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(pc.IN, pc.IN)

    def forward(self, x):
        if dist.get_rank() == 0:
            raise FloatingPointError("boom before the first send")
        return self.lin(x)


def _raises_before_first_send(role):
    import torch.nn.functional as F

    from fleetlike import fleet

    fleet.init(role, strategy=pc.strategy("1F1B", 2, 1))
    net = pc.make_net()
    net[1] = _FirstForwardRaises()
    model = fleet.distributed_model(net, loss_fn=F.cross_entropy)
    opt = fleet.distributed_optimizer(pc.make_opt("momentum", model.parameters()))
    start = time.monotonic()
    try:
        model.train_batch(pc.my_batch(0, 0, 1), opt)
        return "no error", 0.0
    except Exception as exc:  # noqa: BLE001 - the test reads it
        return f"{type(exc).__name__}: {exc}", time.monotonic() - start
    finally:
        fleet.shutdown()


def test_a_stage_failing_before_its_first_send_ends_its_neighbour_too():
    """The neighbour waits for a ring that will never be made: the store's abort mark ends it."""
    results = run_ranks(_raises_before_first_send, 2, timeout=60)
    for rank, (message, took) in enumerate(results):
        assert "boom before the first send" in message, (rank, message)
        assert took < 20, (rank, took)
    assert results[0][0].startswith("FloatingPointError") and results[1][0].startswith("PipelineStageError")


def test_a_ring_without_room_in_dev_shm_is_refused_with_the_fix(monkeypatch):
    """tmpfs grants a file's size at once but its pages only when touched: a full /dev/shm would
    kill the process at the first copy (SIGBUS), so the pages are claimed when the ring is made."""
    import errno

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    path = _path("full")
    with pytest.raises(OSError, match=r"no room for a \d+-byte ring .*--shm-size.*p2p='gloo'"):
        Ring.create(path, 4096)
    assert not os.path.exists(path)

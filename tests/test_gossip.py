"""Gossip (down-sampling) compression, ``strategy.gossip``: 1/n of the bytes, nothing lost, converges.

* property (hypothesis, one process): over any run of steps, what `Downsampler` delivers plus
  the residual equals the sum of the gradients fed in (error feedback loses nothing), every
  element travels once every n steps, and a step sends ``ceil`` of 1/n of the bucket;
* 4 gloo ranks on scikit-learn's digits, the program style and the eager loop: the bytes the
  world communicator moves per step are 1/4 of synchronous data parallel's (its own byte counts),
  and test accuracy ends within 1 point of uncompressed training.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from amp_common import accuracy, digits_loss, digits_model, digits_split, shard_batch
from fleetlike.collectives import Downsampler, sent_elements
from fleetlike.testing import run_ranks
from localsgd_digits import BATCH, MOMENTUM, lr_at

STEPS = 300


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.integers(2, 6), st.integers(1, 13), st.lists(st.integers(1, 9), min_size=1, max_size=3))
def test_error_feedback_loses_nothing(numel: int, n: int, steps: int, sizes: list[int]) -> None:
    for packed in (None, sizes):
        total = numel if packed is None else sum(packed)
        sampler = Downsampler(n)
        fed = torch.zeros(total, dtype=torch.float64)
        delivered = torch.zeros(total, dtype=torch.float64)
        last_sent = torch.full((total,), -1)
        g = torch.Generator().manual_seed(numel * 31 + steps)
        for step in range(steps):
            grad = torch.randn(total, generator=g, dtype=torch.float64)
            fed += grad
            flat = grad.clone()
            sent, where = sampler.encode("b", flat, sizes=packed)
            expect = (sent_elements(total, n, step % n) if packed is None
                      else sum(sent_elements(s, n, step % n) for s in packed))
            assert sent.numel() == expect <= sum(math.ceil(s / n) for s in (packed or [total]))
            sampler.decode(flat, sent, where)  # a world of one: the average is the value itself
            delivered += flat
            last_sent[flat != 0] = step
        torch.testing.assert_close(delivered + sampler.residuals["b"], fed, rtol=0, atol=1e-12)
        if steps >= n:  # every element has travelled in the last n steps
            assert bool((last_sent >= steps - n).all())


def _digits(role, gossip_n: int, eager: bool) -> dict[str, float]:
    from fleetlike import DistributedStrategy, Executor, fleet

    torch.set_num_threads(1)
    torch.manual_seed(0)
    strategy = DistributedStrategy(gossip=gossip_n > 1, gossip_configs={"downsample_n_elements": max(gossip_n, 2)})
    with fleet.session(role):
        (x, y), (xt, yt) = digits_split(0)
        model = digits_model(role.rank)
        world = fleet.context().groups.world
        if eager:
            model = fleet.distributed_model(model)
        opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=lr_at(0, STEPS), momentum=MOMENTUM), strategy)
        if not eager:
            opt.minimize(digits_loss, model)
            Executor().run(fleet.startup_program)
        per_step = []
        for step in range(STEPS):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, STEPS)
            feed = shard_batch(x, y, step, role.rank, role.world_size, BATCH)
            before = world.stats.snapshot()["bytes"].get("all_reduce", 0)
            if eager:
                opt.zero_grad()
                digits_loss(model, feed).backward()
                opt.step()
            else:
                fleet.main_program.run(feed)
            per_step.append(world.stats.snapshot()["bytes"].get("all_reduce", 0) - before)
        net = model.module if hasattr(model, "module") else model
        return {"acc": accuracy(net, xt, yt), "bytes": per_step[5:],
                "grad_bytes": sum(p.numel() * 4 for p in net.parameters())}


def _digits_runs(role, runs: list[tuple[bool, int]]) -> dict[tuple[bool, int], dict[str, float]]:
    """Each (eager, gossip_n) run in turn in the same ranks: one job instead of four (each run
    its own session, seeds and model, as in separate jobs)."""
    return {(eager, n): _digits(role, n, eager) for eager, n in runs}


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_gossip_bytes_and_digits_convergence() -> None:
    runs = [(eager, n) for eager in (False, True) for n in (1, 4)]
    by_rank = run_ranks(_digits_runs, 4, runs, timeout=180)
    results = {}
    for run in runs:
        accs = {ranks[run]["acc"] for ranks in by_rank}
        assert len(accs) == 1, f"ranks disagree: {accs}"
        results[run] = by_rank[0][run]
    print("test accuracy (eager, n):", {run: results[run]["acc"] for run in runs})
    for eager in (False, True):
        sync, gossip = results[(eager, 1)], results[(eager, 4)]
        full = sync["grad_bytes"]
        assert set(sync["bytes"]) == {full}, sync["bytes"][:4]
        # one bucket of 4 tensors strided separately: at most one extra element per tensor
        assert all(full / 4 - 16 <= b <= full / 4 + 16 for b in gossip["bytes"]), (full, gossip["bytes"][:8])
        assert sync["acc"] > 0.93
        assert abs(sync["acc"] - gossip["acc"]) <= 0.01, (eager, sync["acc"], gossip["acc"])

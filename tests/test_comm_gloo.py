"""Every collective on real gloo ranks equals its numpy reference (hypothesis over cases)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from comm_cases import case_strategy, check_by_world, run_by_world
from fleetlike.comm import CommGroups, SingleCommunicator
from fleetlike.testing import make_world, run_ranks


def _cases_by_world(role, draws):
    """`comm_cases.run_by_world` on worlds of the job's first ranks: the world itself, a gloo
    split of it, or for one rank the `SingleCommunicator` a one-rank job gets."""
    world = make_world(role)

    def world_of(n):
        if n == world.size:
            return world
        if n == 1:  # (every rank takes this branch: no split is issued)
            return SingleCommunicator("world", 0) if role.rank == 0 else None
        return world.split(0 if role.rank < n else None, key=role.rank)

    try:
        return run_by_world(draws, world_of, keep=world)
    finally:
        world.close()


@st.composite
def world_and_cases(draw):
    world = draw(st.integers(1, 4))
    cases = draw(st.lists(case_strategy(world), min_size=1, max_size=8))
    return world, cases


@pytest.mark.timeout(300)
@settings(max_examples=1)
@given(st.lists(world_and_cases(), min_size=25, max_size=25))
@pytest.mark.slow
def test_collectives_match_numpy(draws):
    """25 draws of (world size, cases) in one job of 4 ranks (starting a world costs more than
    its cases), each on a world of the job's first ranks."""
    check_by_world(draws, run_ranks(_cases_by_world, 4, draws, timeout=240))


def _split_sums(role, colors):
    world = make_world(role)
    try:
        sub = world.split(colors[role.rank], key=-role.rank)
        if sub is None:
            return None
        return sub.ranks, sub.rank, sub.all_reduce(torch.tensor([role.rank])).item()
    finally:
        world.close()


@pytest.mark.slow
@pytest.mark.timeout(200)
@settings(max_examples=6)
@given(st.integers(1, 4).flatmap(lambda n: st.lists(st.one_of(st.none(), st.integers(0, 2)), min_size=n, max_size=n)))
def test_split_by_color(colors):
    results = run_ranks(_split_sums, len(colors), colors, timeout=60)
    for rank, (color, res) in enumerate(zip(colors, results)):
        if color is None:
            assert res is None
            continue
        members = [r for r, c in enumerate(colors) if c == color]
        ranks, sub_rank, total = res
        assert list(ranks) == sorted(members, reverse=True)  # key = -rank reverses the order
        assert ranks[sub_rank] == rank
        assert total == sum(members)


def _topology_groups(role):
    world = make_world(role)
    groups = CommGroups(world, role)
    try:
        return (
            groups.intra.all_gather_flat(torch.tensor([role.rank])).tolist(),
            groups.inter.all_gather_flat(torch.tensor([role.rank])).tolist(),
            [ring.all_reduce(torch.tensor([1])).item() for ring in groups.rings(3)],
        )
    finally:
        groups.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nodes,per_node", [(2, 2), (2, 1), (1, 4), (4, 1)])
def test_intra_inter_and_rings(nodes, per_node):
    results = run_ranks(_topology_groups, nodes * per_node, nodes=nodes, timeout=45)
    for rank, (intra, inter, rings) in enumerate(results):
        node, local = divmod(rank, per_node)
        assert intra == [node * per_node + i for i in range(per_node)]
        assert inter == [n * per_node + local for n in range(nodes)]
        assert rings == [nodes * per_node] * 3


def _stats(role):
    world = make_world(role)
    try:
        world.all_reduce(torch.zeros(1000))
        world.all_gather_flat(torch.zeros(10, dtype=torch.float64))
        return world.stats.calls, world.stats.bytes, world.stats.wire_bytes
    finally:
        world.close()


def test_stats_count_calls_and_bytes():
    calls, nbytes, wire = run_ranks(_stats, 2, timeout=30)[0]
    assert calls == {"all_reduce": 1, "all_gather": 1}
    assert nbytes == {"all_reduce": 4000, "all_gather": 160}
    assert wire == 4000 + 80  # ring: 2(n-1)/n * 4000 and (n-1)/n * 160 for n = 2


def _exit_handlers(role):
    import atexit

    before = atexit._ncallbacks()
    worlds = [make_world(role) for _ in range(2)]
    after = atexit._ncallbacks()
    for w in worlds:
        w.close()
    return after - before


@pytest.mark.timeout(60)
def test_a_process_with_gloo_groups_settles_them_once_at_exit():
    """torch's gloo workers can need the GIL after the interpreter began finalising (the process
    then aborts): the first gloo group a process makes registers one exit handler that hands
    them the GIL, however many groups follow."""
    assert run_ranks(_exit_handlers, 2, timeout=50) == [1, 1]

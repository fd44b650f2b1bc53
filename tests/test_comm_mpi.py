"""Every collective on real MPI ranks (``mpiexec -n N``) equals its numpy reference.

The mirror of ``test_comm_gloo.py`` for the ``mpi`` backend. Starting an MPI job costs a few
seconds of CPU per rank (each imports torch), so one ``mpiexec -n 4`` run executes every case of
several draws and every split of several colourings: the test process draws them,
`mpi_runner.run_mpi` ships them to the ranks in a pickle, each draw runs on a world of the job's
first ``world`` ranks, and the results come back one pickle per rank.
"""

from __future__ import annotations

import pytest
from comm_cases import case_strategy, check_by_world
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi_runner import mpi_unavailable_reason, run_mpi

_REASON = mpi_unavailable_reason()
pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(_REASON is not None, reason=_REASON or ""),
]


@st.composite
def world_and_cases(draw):
    world = draw(st.integers(1, 4))
    cases = draw(st.lists(case_strategy(world), min_size=1, max_size=20))
    return world, cases


#: several colourings of one world per draw (one colour per rank, None: not in any part), three
#: draws of worlds of 1 to 4 ranks
colorings = st.lists(
    st.integers(1, 4).flatmap(
        lambda n: st.lists(st.lists(st.one_of(st.none(), st.integers(0, 2)), min_size=n, max_size=n),
                           min_size=1, max_size=4)
    ),
    min_size=3, max_size=3,
)


@pytest.mark.timeout(240)
@settings(max_examples=1)
@given(st.lists(world_and_cases(), min_size=5, max_size=5), colorings)
@pytest.mark.slow
def test_collectives_match_numpy_and_split_by_color(draws, splits):
    """One ``mpiexec -n 4`` job (a job's start costs every rank a torch import; a collective or
    a split does not) runs, in turn: five draws of (world size, cases), each on a world of the
    job's first ranks (`mpi_runner._sub_world`), each case against its numpy reference; then
    three draws of colourings, each split of such a world followed by an allreduce on each part."""
    per_rank = run_mpi(4, "several", [("cases_by_world", draws), ("split_by_world", splits)], timeout=150)
    check_by_world(draws, [r[0] for r in per_rank])
    check_splits(splits, [r[1] for r in per_rank])


def check_splits(draws, per_rank) -> None:
    """Each rank's ``(ranks, sub_rank, sub_size, allreduce of the ranks)`` per colouring: the
    members of its colour, ordered by ``key=-rank``; None outside a part or outside the world."""
    for d, colorings in enumerate(draws):
        assert all(per_rank[r][d] is None for r in range(len(colorings[0]), 4))
        for i, colors in enumerate(colorings):
            for rank, color in enumerate(colors):
                res = per_rank[rank][d][i]
                if color is None:
                    assert res is None
                    continue
                members = [r for r, c in enumerate(colors) if c == color]
                ranks, sub_rank, sub_size, total = res
                assert list(ranks) == sorted(members, reverse=True)  # key = -rank reverses the order
                assert sub_size == len(members)
                assert ranks[sub_rank] == rank
                assert total == sum(members)


@pytest.mark.timeout(90)
def test_create_world_from_mpi_role():
    n = 3
    results = run_mpi(n, "create_world", None, timeout=60)
    total = float(sum(range(1, n + 1)))
    for rank, res in enumerate(results):
        assert res["auto"] == "mpi"  # a role whose source is "mpi" picks the mpi backend
        assert res["maker"] == (rank, n, "mpi")
        assert res["explicit_world"] == ("mpi", rank, n, total)
        assert res["maker_world"] == ("mpi", rank, n, total)
        assert res["mismatch"] is not None and "rank" in res["mismatch"]
        assert res["intra"] == list(range(n))  # one node: intra is the world, inter is this rank
        assert res["inter"] == [rank]
        assert res["rings"] == [n] * 3


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["blocking", "async"])
def test_a_collective_a_peer_never_joins_aborts_the_job_after_the_timeout(mode):
    """MPI would wait forever; the watchdog reports the collective and aborts the job."""
    import time

    t0 = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_mpi(2, "stall", {"timeout": 2.0, "mode": mode, "sleep": 60}, timeout=45)
    elapsed = time.monotonic() - t0
    text = str(info.value)
    assert "exited with" in text, text  # mpiexec ended the job, the test's timeout did not
    assert "fleetlike: collective #2 all_reduce on 'world' (mpi) has not finished after" in text, text
    assert "on rank 0 (timeout 2s)" in text and "the job is being aborted" in text, text
    assert elapsed < 40, elapsed  # rank 1 sleeps 60 s: the job did not wait for it


KINDS = ["all_reduce", "all_gather", "broadcast", "reduce_scatter"]


def _shapes(kind: str) -> list[tuple[int, ...]]:
    return [(4,), (6,)] if kind != "reduce_scatter" else [(4,), (8,)]


@pytest.fixture(scope="module")
def mismatches() -> dict[str, list]:
    """Every kind's mismatch in one MPI job (in turn, each on its own communicator): kind ->
    each rank's (error, allreduce after it)."""
    specs = [{"kind": k, "shapes": _shapes(k)} for k in KINDS]
    per_rank = run_mpi(2, "mismatches", specs, timeout=90)
    return {kind: [rank[i] for rank in per_rank] for i, kind in enumerate(KINDS)}


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind", KINDS)
def test_different_sizes_raise_on_every_rank_naming_each_shape(kind, mismatches):
    """MPI on its own truncates ("Message from rank 1 ... truncated"), errors on one rank only
    (broadcast) or aborts the job; the default size check raises on every rank first."""
    shapes = _shapes(kind)
    results = mismatches[kind]
    for rank, (error, after) in enumerate(results):
        assert error is not None and error[0] != "other", (rank, error)
        text, rows = error
        assert "found by the size check" in text, text
        assert [r["shape"] for r in rows] == [str(s) for s in shapes], text
        assert after == 3.0

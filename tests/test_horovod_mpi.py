"""``import fleetlike.horovod as hvd`` under ``mpiexec -n 2`` and ``-n 3``: ``hvd.init()`` detects
the MPI launch, the collectives run on the MPI backend, and every result of the shared suite
(`horovod_common.rank_suite`) matches the same references as on gloo (`test_horovod.check_suite`).
"""

from __future__ import annotations

import pytest
from mpi_runner import mpi_unavailable_reason, run_mpi
from test_horovod import check_suite

_REASON = mpi_unavailable_reason()
pytestmark = [pytest.mark.mpi, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_every_call_on_mpi(world: int) -> None:
    results = run_mpi(world, "call", {"target": "horovod_common:mpi_rank", "data": {"rings": 2}}, timeout=200)
    for res in results:
        assert res["topo"][7:9] == (True, False)  # mpi_enabled, not gloo
    check_suite(results, world)

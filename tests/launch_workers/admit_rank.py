"""Test worker: one rank of a two-rank job meeting through `fleetlike.comm.rendezvous.connect`
(the job's secret in FLEETLIKE_JOB_SECRET), which waits for a go file before it connects.

Usage: admit_rank.py RANK ENDPOINTS JOB_ID GO_FILE OUT   ->   OUT (JSON: the rank's view, or its error)
"""

import json
import os
import sys
import time


def main() -> None:
    rank, endpoints, job_id, go, out = sys.argv[1:]
    deadline = time.monotonic() + 60
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.02)
    from fleetlike.comm.rendezvous import connect
    from fleetlike.roles.role import Role

    role = Role.from_endpoints(int(rank), endpoints.split(","), job_id=job_id)
    started = time.monotonic()
    try:
        store = connect(role, timeout=30)
        store.set(f"hello/{rank}", f"from rank {rank}")
        other = store.get(f"hello/{1 - int(rank)}").decode()
        report = {"ok": True, "other": other}
    except Exception as exc:  # noqa: BLE001 - the error is what the test checks
        report = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    report["seconds"] = time.monotonic() - started
    with open(out, "w") as fh:
        json.dump(report, fh)
    # rank 0 hosts the store: the other rank reads its last value (or meets its error) first
    time.sleep(0.5 if report["ok"] else 5.0)


if __name__ == "__main__":
    main()

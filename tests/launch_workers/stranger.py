"""Test helper: a process that does not hold a job's secret and tries to get into the job.

Usage: stranger.py HOST:PORT MARKER REPORT MODE [ARGS...] -> REPORT (JSON: what it saw and how
each attempt ended). The payloads it tries to send write MARKER when unpickled.

Modes:
  store ENDPOINTS_CSV   read the job id, join as the late rank 1 (hvd.init with another secret,
                        then with none), send pickled payloads, overwrite keys
  elastic RUN_ID        join an elastic job's rendezvous with another secret; plant torch
                        rendezvous state where the old layout kept it
"""

import datetime
import json
import os
import sys
import time
import traceback


class Payload:
    """Runs when unpickled: the proof that a stranger's data was loaded."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def attempt(report: dict, name: str, fn) -> None:
    try:
        report[name] = {"ok": True, "value": fn()}
    except BaseException as exc:  # noqa: BLE001 - every outcome goes to the report
        report[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                        "trace": traceback.format_exc()[-2000:]}


def main() -> None:
    endpoint, marker, out, mode, *rest = sys.argv[1:]
    import torch.distributed as dist

    host, port = endpoint.rsplit(":", 1)
    raw = dist.TCPStore(host, int(port), None, False, datetime.timedelta(seconds=10))
    report: dict = {}
    seen = {}
    for key in ("fleetlike/job_id", "fleetlike/job", "fleetlike/hello", "fleetlike/knock",
                "fleetlike/knock/1", "job/default/0/arrived/0", "torch.rendezvous.default"):
        seen[key] = raw.get(key).decode(errors="replace") if raw.check([key]) else None
    report["read"] = seen
    if mode == "store":
        endpoints = rest[0]
        os.environ.update({
            "PADDLE_TRAINER_ID": "1", "PADDLE_TRAINERS_NUM": "2", "PADDLE_TRAINER_ENDPOINTS": endpoints,
            "PADDLE_CURRENT_ENDPOINT": endpoints.split(",")[1], "RANK": "1", "WORLD_SIZE": "2",
            "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": host, "MASTER_PORT": port,
            "FLEETLIKE_JOB_SECRET": "ab" * 32,  # a secret, not the job's
        })
        import fleetlike.horovod as hvd

        def join_and_send() -> str:
            hvd.init()
            hvd.allgather_object(Payload(marker))
            hvd.broadcast_object(Payload(marker), root_rank=1)
            return "joined"

        attempt(report, "join_wrong_secret", join_and_send)
        del os.environ["FLEETLIKE_JOB_SECRET"]
        os.environ["FLEETLIKE_SECRET_DIR"] = os.path.join(os.path.dirname(out), "stranger-secrets")
        attempt(report, "join_no_secret", join_and_send)
        time.sleep(1.0)  # rank 0 reads the knocks before the counter is spoiled below
        for key in ("fleetlike/job", "fleetlike/knock", "job/default/0/arrived/1", "fleetlike/job_id"):
            attempt(report, f"set {key}", lambda key=key: raw.set(key, "stranger") or "set")
        attempt(report, "planted proof", lambda: raw.set("job/default/0/proof/1", json.dumps(
            {"rank": 1, "endpoint": "x", "tag": "0" * 64})) or "set")
    elif mode == "elastic":
        run_id = rest[0]
        os.environ["FLEETLIKE_JOB_SECRET"] = "cd" * 32
        from fleetlike.elastic.membership import ElasticSettings, Membership

        settings = ElasticSettings(endpoint, 1, 3, 1.0, run_id, "127.0.0.1", "127.0.0.1:1", 0)
        attempt(report, "join_wrong_secret", lambda: Membership(settings, join_timeout=10).form(10)[0].rank)
        # the state torch's rendezvous keeps, where a store without the secret's prefix had it
        attempt(report, "plant state", lambda: raw.set(f"torch.rendezvous.{run_id}", "stranger") or "set")
    with open(out, "w") as fh:
        json.dump(report, fh)


if __name__ == "__main__":
    main()

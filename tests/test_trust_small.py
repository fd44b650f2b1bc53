"""Smaller doors of the trust boundary, each checked where it is decided (one process).

A ``COMPLETE`` that is a directory or gigabytes long is refused by name without being read; a
``.ckpt.old-*`` another user planted in a shared folder is never loaded; an all-zero secret is
refused; ports and counts in Unicode digits are refused; the launchers' secret file is made
0600 in a 0700 folder and removed by its maker; an image linked from outside the data root is
refused; a checkpoint path that is a symbolic link is written through (another user's is not
followed); a checkpoint folder every user may write (0777) is refused.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from fleetlike.comm.secret import JobSecret, SecretError
from fleetlike.fleet.checkpoint import CheckpointError, resolve
from fleetlike.fleet.checkpoint_files import COMPLETE, atomic_dir, save_pt, verify
from fleetlike.launch.config import parse_config
from fleetlike.launch.flags import LaunchInputError

# its jobs fill both cores by themselves (see conftest)
pytestmark = pytest.mark.alone


def _save(target: Path) -> None:
    with atomic_dir(target) as tmp:
        save_pt({"w": torch.ones(2)}, tmp / "state.pt", "state")


def test_a_complete_marker_that_is_a_directory_or_huge_is_refused_unread(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _save(ckpt)
    assert verify(ckpt) >= 3
    marker = ckpt / COMPLETE
    marker.unlink()
    marker.mkdir()
    with pytest.raises(CheckpointError, match="is a directory"):
        verify(ckpt)
    marker.rmdir()
    with open(marker, "wb") as fh:  # sparse: 2 GB that would be read whole
        fh.truncate(2 << 30)
    started = time.monotonic()
    with pytest.raises(CheckpointError, match="far more than a checkpoint's file list"):
        verify(ckpt)
    assert time.monotonic() - started < 1.0


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_an_old_checkpoint_planted_by_another_user_is_never_loaded(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # a sticky folder every user may write, like /tmp
    planted = shared / ".ckpt.old-planted"
    _save(planted)
    os.chown(planted, 65534, 65534)
    (shared / "ckpt").mkdir()  # an incomplete save: no COMPLETE
    with pytest.raises(CheckpointError, match="is not a complete fleetlike checkpoint"):
        resolve(shared / "ckpt")
    os.chown(planted, os.getuid(), os.getgid())  # the user's own is the previous checkpoint
    assert resolve(shared / "ckpt") == planted


def test_an_all_zero_secret_is_refused() -> None:
    with pytest.raises(SecretError, match="all zeros"):
        JobSecret("00" * 32)
    JobSecret("01" * 32)  # a value (not a good one) is the user's choice


@pytest.mark.parametrize("flag", ["--started_port=６１７０", "--nproc_per_node=２", "--max_restarts=１"])
def test_unicode_digits_are_not_numbers(tmp_path: Path, flag: str) -> None:
    with pytest.raises(LaunchInputError, match="not an integer in ASCII digits"):
        parse_config([flag, "train.py"], environ={})


@pytest.mark.default_port
def test_values_sent_to_host_agents_are_not_on_their_command_lines(tmp_path: Path) -> None:
    """``-np/-H`` with ``-x``: the forwarded variables (and FLEETLIKE_* ones) reach the workers
    through the agent's standard input, never its command line (readable by every user)."""
    import json
    import subprocess
    import sys

    from test_launch_run import WORKERS, clean_env

    out = tmp_path / "out"
    out.mkdir()
    env = clean_env(MY_TOKEN="tok-" + "7f3a" * 8, FLEETLIKE_CUSTOM="fl-" + "9c1d" * 8)
    done = subprocess.run([sys.executable, "-m", "fleetlike.launch", "-np", "2", "-H", "localhost:2", "-x", "MY_TOKEN",
                           sys.executable, str(WORKERS / "ancestors.py"), str(out), "MY_TOKEN"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(2):
        seen = json.loads((out / f"seen.{rank}").read_text())
        assert seen["value"] == env["MY_TOKEN"] and seen["ancestors"] >= 2
        assert not seen["on_a_command_line"], seen


@pytest.mark.parametrize("field, value, said", [
    ("fuse_grad_size_in_MB", 1e308, "fuse_grad_size_in_MB must be a number in (0, 1.07374e+09)"),
    ("localsgd_configs", {"k_steps": 10**20}, "localsgd_configs.k_steps must be an int in [1, 2147483648]"),
])
def test_sizes_too_large_to_use_are_refused_by_name(field: str, value: object, said: str) -> None:
    from fleetlike.config import DistributedStrategy
    from fleetlike.config.fields import StrategyValueError

    strategy = DistributedStrategy()
    with pytest.raises(StrategyValueError, match=__import__("re").escape(said)):
        setattr(strategy, field, value)


def test_a_symlink_out_of_the_data_root_is_refused_naming_where_it_points(tmp_path: Path) -> None:
    """A link inside the root that points out of it (another user's files, ``/etc``) is refused,
    even with ``on_error="skip"``; links that stay inside, and a root that is itself a link, work."""
    from PIL import Image

    from fleetlike.io import DataRootError, ImageFolder, ImageListDataset, ToTensor
    from test_io_datasets import make_images, write_list

    root, private = tmp_path / "root", tmp_path / "private"
    root.mkdir()
    private.mkdir()
    entries = make_images(root, n=3)
    Image.new("RGB", (4, 4), (9, 9, 9)).save(private / "secret.jpg")
    (root / "class_0" / "leak.jpg").symlink_to(private / "secret.jpg")
    (root / "class_1" / "alias.jpg").symlink_to(root / entries[0][0])  # stays inside: fine
    (root / "class_9").symlink_to(private, target_is_directory=True)
    listed = [*entries, ("class_1/alias.jpg", 1), ("class_0/leak.jpg", 0), ("class_9/secret.jpg", 2)]
    for on_error in ("raise", "skip"):
        ds = ImageListDataset(root, write_list(tmp_path / "l.txt", listed), transform=ToTensor(), on_error=on_error)
        assert torch.equal(ds[3][0], ds[0][0])
        for index, name in ((4, "class_0/leak.jpg"), (5, "class_9/secret.jpg")):
            with pytest.raises(DataRootError) as caught:
                ds[index]
            assert str(caught.value) == (
                f"{str(root / name)!r} resolves to {str(private / 'secret.jpg')!r}, outside the data root "
                f"{str(root)!r} (a symbolic link points out of it); put the files inside the root, or give the "
                "folder that holds them as the root")
    folder = ImageFolder(root)
    refused = [p for i, (p, _) in enumerate(folder.samples) if _raises(folder, i)]
    assert sorted(refused) == ["class_0/leak.jpg", "class_9/secret.jpg"]
    link_root = tmp_path / "link-root"
    link_root.symlink_to(root, target_is_directory=True)
    assert ImageListDataset(link_root, write_list(tmp_path / "m.txt", entries))[0][1] == entries[0][1]


def _raises(dataset: Any, index: int) -> bool:
    from fleetlike.io import DataRootError

    try:
        dataset[index]
    except DataRootError:
        return True
    return False


def _value(path: Path) -> float:
    from fleetlike.fleet.checkpoint_files import load_pt

    found = resolve(path)
    return float(load_pt(found / "state.pt", "state", verify(found))["w"][0])


def _save_value(target: Path, value: float) -> None:
    with atomic_dir(target) as tmp:
        save_pt({"w": torch.full((2,), value)}, tmp / "state.pt", "state")


def test_a_checkpoint_path_that_is_a_symlink_is_written_through(tmp_path: Path) -> None:
    """``run/ckpt -> disk/ckpt``: each save replaces ``disk/ckpt`` atomically, the link stays a
    link, nothing is left beside either, and a load through the link reads the newest save."""
    run, disk = tmp_path / "run", tmp_path / "disk"
    run.mkdir()
    disk.mkdir()
    link = run / "ckpt"
    link.symlink_to(disk / "ckpt", target_is_directory=True)  # dangling until the first save
    for value in (1.0, 2.0, 3.0):
        _save_value(link, value)
        assert link.is_symlink() and os.readlink(link) == str(disk / "ckpt")
        assert (disk / "ckpt").is_dir() and not (disk / "ckpt").is_symlink()
        assert sorted(p.name for p in run.iterdir()) == ["ckpt"]
        assert sorted(p.name for p in disk.iterdir()) == ["ckpt"]
        assert resolve(link) == disk / "ckpt" and _value(link) == value
    # a save cut short beside the target: the load through the link falls back to the previous one
    (disk / "ckpt").rename(disk / ".ckpt.old-host-1-cafe")
    (disk / "ckpt").mkdir()
    assert _value(link) == 3.0


@pytest.mark.skipif(os.geteuid() != 0, reason="a link owned by another user needs root")
def test_another_users_link_is_not_followed(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    mine = tmp_path / "mine"
    _save_value(mine, 5.0)
    planted = shared / "ckpt"
    planted.symlink_to(mine, target_is_directory=True)
    os.lchown(planted, 65534, 65534)
    for act in (lambda: _save_value(planted, 6.0), lambda: resolve(planted)):
        with pytest.raises(CheckpointError, match=r"is a symbolic link owned by uid 65534, not by this user"):
            act()
    assert _value(mine) == 5.0


def test_a_checkpoint_folder_every_user_may_write_is_refused(tmp_path: Path) -> None:
    """Mode 0777 without the sticky bit: save and load both refuse, naming the folder, its mode
    and the fix; 1777 (sticky, like /tmp) and 0770 (a team's group) are accepted."""
    folder = tmp_path / "open"
    folder.mkdir()
    _save_value(folder / "ckpt", 1.0)
    os.chmod(folder, 0o777)
    expected = (f"checkpoint {folder / 'ckpt'}: its folder {folder} may be written by every user (mode 777, "
                "without the sticky bit), so anyone could replace the checkpoint with their own, which a load "
                f"would then take for this job's; run chmod o-w {folder} (or chmod +t), or keep checkpoints in a "
                "folder of your own")
    for act in (lambda: _save_value(folder / "ckpt", 2.0), lambda: resolve(folder / "ckpt")):
        with pytest.raises(CheckpointError) as caught:
            act()
        assert str(caught.value) == expected
    for mode in (0o1777, 0o770):
        os.chmod(folder, mode)
        assert _value(folder / "ckpt") == 1.0
        _save_value(folder / "ckpt", 2.0)
        assert _value(folder / "ckpt") == 2.0
        _save_value(folder / "ckpt", 1.0)


def test_what_a_holder_of_the_key_prefix_can_do_with_counters() -> None:
    """Counters are plain numbers: whoever learned the prefix (without the secret) can move one,
    and a member's count follows; the record it writes where a count points is refused; a count
    moved past the records makes the reader wait for one that never comes, until the store's
    timeout. A launcher's summary of the nodes then says the store was lost, and names nothing
    the stranger wrote."""
    import datetime
    import json
    import secrets

    import torch.distributed as dist

    from fleetlike.comm import JobSecret, job_store
    from fleetlike.comm.rendezvous import greet
    from fleetlike.comm.signed_store import StoreTampered
    from fleetlike.launch.nodewatch import EVENTS_KEY, NodeWatch

    secret = JobSecret(secrets.token_hex(32))
    second = datetime.timedelta(seconds=1)
    server = dist.TCPStore("127.0.0.1", 0, None, True, second)
    greet(server, secret, "job")
    member = job_store(server, secret)
    stranger = dist.PrefixStore(secret.prefix, dist.TCPStore("127.0.0.1", server.port, None, False, second))
    assert member.add("counter", 1) == 1
    assert stranger.add("counter", 5) == 6 and member.add("counter", 0) == 6
    endpoint = f"127.0.0.1:{server.port}"
    watch = NodeWatch(endpoint, "127.0.0.1", store=server, timeout=1.0, secret=secret)
    assert watch.summary() == "nodes lost: -; nodes joined: -"
    stranger.add(EVENTS_KEY, 1)  # past the records: none at EVENTS_KEY/1
    started = time.monotonic()
    said = watch.summary()
    assert said.startswith(f"nodes: unknown (the rendezvous store at {endpoint} was lost: ") and secret.prefix not in said
    assert time.monotonic() - started < 5
    stranger.set(f"{EVENTS_KEY}/1", json.dumps({"commit": 1, "nodes_lost": ["10.6.6.6"], "nodes_joined": []}))
    with pytest.raises(StoreTampered, match=f"the value of '{EVENTS_KEY}/1' .* is not signed with this job's secret"):
        member.get(f"{EVENTS_KEY}/1")
    fresh = NodeWatch(endpoint, "127.0.0.1", store=server, timeout=1.0, secret=secret)
    assert "StoreTampered" in fresh.summary() and "10.6.6.6" not in fresh.summary()

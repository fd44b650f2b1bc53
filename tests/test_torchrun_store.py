"""Under torchrun every rank joins the store torchrun's agent hosts.

torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``, its default) hosts one store for the whole job at
``MASTER_ADDR:MASTER_PORT``. A rank 0 that hosted a second store on a port next to it would bind a
port nobody reserved: any outgoing connection on the machine may be given it first ("Address
already in use"). The agent's store also outlives a restart of the workers, so each generation
meets in its own key space. On several nodes the agents' restart counts differ, and rank 0 hosts
a store of its own for each start instead.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from examples_common import clean_env
from fleetlike.roles import detect_role
from helpers import run_job, torchrun_module

TORCHRUN_ENV = {"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "3",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "rdzv9"}


def test_ranks_join_the_agents_store_at_master_port() -> None:
    role = detect_role({**TORCHRUN_ENV, "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert role.master_hosted and role.master_endpoint == "127.0.0.1:29500"
    # the endpoints (names of the ranks, never bound) keep their ports after torch's
    assert role.endpoints == ("127.0.0.1:29501", "127.0.0.1:29502", "127.0.0.1:29503")
    assert role.generation == 0


def test_fleetlikes_master_addr_naming_the_agents_host_still_joins_its_store() -> None:
    role = detect_role({**TORCHRUN_ENV, "TORCHELASTIC_USE_AGENT_STORE": "True", "FLEETLIKE_MASTER_ADDR": "127.0.0.1"})
    assert role.master_hosted and role.master_endpoint == "127.0.0.1:29500"


@pytest.mark.parametrize(("extra", "master"), [
    ({"TORCHELASTIC_USE_AGENT_STORE": "False"}, "127.0.0.1:29501"),
    ({}, "127.0.0.1:29501"),
    ({"TORCHELASTIC_USE_AGENT_STORE": "True", "FLEETLIKE_MASTER_PORT": "7000"}, "127.0.0.1:7000"),
    # the agent's store listens at MASTER_ADDR: another rendezvous host is hosted by rank 0
    ({"TORCHELASTIC_USE_AGENT_STORE": "True", "FLEETLIKE_MASTER_ADDR": "127.0.0.2"}, "127.0.0.2:29501"),
])
def test_without_an_agent_store_rank_0_hosts_one(extra: dict[str, str], master: str) -> None:
    role = detect_role({**TORCHRUN_ENV, **extra})
    assert not role.master_hosted
    assert role.master_endpoint == master


def test_the_restart_count_is_the_roles_generation_on_the_agents_store() -> None:
    agent = {**TORCHRUN_ENV, "TORCHELASTIC_USE_AGENT_STORE": "True"}
    role = detect_role({**agent, "TORCHELASTIC_RESTART_COUNT": "2"})
    assert role.master_hosted and role.generation == 2 and role.job_id == "rdzv9"
    with pytest.raises(ValueError, match=r"TORCHELASTIC_RESTART_COUNT=-1 must be >= 0"):
        detect_role({**agent, "TORCHELASTIC_RESTART_COUNT": "-1"})
    # a store rank 0 hosts is new at every start: nothing of a dead start to keep apart
    assert detect_role({**TORCHRUN_ENV, "TORCHELASTIC_RESTART_COUNT": "2"}).generation == 0


def test_on_several_nodes_rank_0_hosts_a_store_for_each_start() -> None:
    """Each node's agent counts its own restarts: a node whose workers were healthy restarts them
    for a peer's failure without counting, so the count cannot name a start on every node."""
    env = {**TORCHRUN_ENV, "RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
           "GROUP_RANK": "1", "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "1"}
    role = detect_role(env)
    assert not role.master_hosted and role.generation == 0
    assert role.master_endpoint == "127.0.0.1:29501"


SCRIPT = textwrap.dedent("""
    import os, sys, time
    import torch
    from fleetlike.comm import create_world
    from fleetlike.roles import detect_role

    role = detect_role()
    world = create_world(role, timeout=60)
    total = torch.tensor([float(world.rank + 1)])
    world.all_reduce(total)
    print(f"gen {role.generation} rank {world.rank} hosted {role.master_hosted} "
          f"at {role.master_endpoint} sum {total.item():g}", flush=True)
    if role.generation == 0 and world.rank == 1:
        sys.exit(3)  # torchrun starts every worker again, on the same agent store
    world.close()
    time.sleep(0.05)
""")


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("secret", ["exported", "made by rank 0"])
def test_a_restarted_generation_meets_on_the_same_agent_store(tmp_path: Path, secret: str) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    extra = {"FLEETLIKE_JOB_SECRET": "ab" * 32} if secret == "exported" else {}
    proc = run_job(torchrun_module("--max_restarts=1", str(script)), cwd=tmp_path,
                   env=clean_env(**extra), timeout=100)
    assert proc.returncode == 0, proc.stdout[-4000:]
    # the workers share torchrun's output: their lines may run together
    seen = sorted(re.findall(r"gen (\d) rank (\d) hosted (\w+) at (\S+) sum (\d+)", proc.stdout))
    assert [(gen, rank) for gen, rank, *_ in seen] == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")], proc.stdout
    assert {(hosted, total) for _, _, hosted, _, total in seen} == {("True", "3")}  # joined it; 1 + 2
    assert len({at for _, _, _, at, _ in seen}) == 1, seen  # both generations on one store

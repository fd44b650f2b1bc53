"""How the ranks divide into pipelines: `HybridCommunicateGroup`, Paddle's names.

Ranks are laid out as Paddle's ``CommunicateTopology(["data", "pipe", "model"])`` does:
``rank = dp_rank * pp_degree + stage_id``. Pipeline ``j`` is ranks ``j*pp .. j*pp+pp-1``
(neighbouring ranks, so a pipeline's activations stay on one node where they can); the
data-parallel group of stage ``s`` is ranks ``s, s+pp, s+2pp, ...``.

Two kinds of communicator serve a pipelined model:

* the stages' activations and gradients travel over a ``torch.distributed`` process group per
  pipeline, because torch's `PipelineStage` sends through ``torch.distributed`` point-to-point
  calls. fleetlike forms torch's default group on a prefix of the job's own store (no second
  store, no second port) unless the script already formed one of the same rank and size.
  Under ``pipeline_configs.p2p = "auto"`` a pipeline's group is of fleetlike's
  ``fleetlike_shm`` backend (`fleetlike.comm.torch_shm`): neighbours on one machine hand over
  through shared memory, others, and every collective on the group, over gloo;
* each stage's gradients are averaged over its data-parallel group with fleetlike's own
  communicators (a split of the job's world), so buckets, hierarchical and 16-bit averaging act.

Example:
    >>> hcg = fleet.get_hybrid_communicate_group()
    >>> x = x.chunk(hcg.get_data_parallel_world_size())[hcg.get_data_parallel_rank()]
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from fleetlike.comm import CommGroups, Communicator
from fleetlike.comm.shm import shm_unsupported
from fleetlike.comm.torch_group import torch_process_group
from fleetlike.comm.torch_shm import BACKEND as SHM_BACKEND
from fleetlike.comm.torch_shm import register as register_shm
from fleetlike.roles import Role

__all__ = ["HybridCommunicateGroup", "ParallelMode", "error_store", "resolve_degrees"]

class ParallelMode:
    """Paddle's ``ParallelMode`` values, as ``get_parallel_mode()`` answers them."""

    DATA_PARALLEL = 0
    TENSOR_PARALLEL = 1
    PIPELINE_PARALLEL = 2
    SHARDING_PARALLEL = 3


def resolve_degrees(world_size: int, dp_degree: int, pp_degree: int) -> tuple[int, int]:
    """``(dp, pp)`` with ``dp = -1`` resolved; ValueError naming the degrees when their product
    is not the world size."""
    dp = world_size // pp_degree if dp_degree == -1 else dp_degree
    if dp_degree == -1 and world_size % pp_degree:
        raise ValueError(
            f"hybrid_configs.pp_degree={pp_degree} does not divide the world size {world_size}, so "
            f"dp_degree=-1 (world / pp_degree) has no value. Fix: choose pp_degree among the "
            f"divisors of {world_size} ({[d for d in range(1, world_size + 1) if world_size % d == 0]}), "
            "or start that many ranks")
    if dp * pp_degree != world_size:
        raise ValueError(
            f"hybrid_configs: dp_degree={dp} x pp_degree={pp_degree} = {dp * pp_degree} ranks, but the job "
            f"has {world_size}. Fix: make dp_degree x pp_degree equal the world size (dp_degree=-1 "
            "takes every rank the pipeline leaves), or start that many ranks")
    return dp, pp_degree


def error_store(world: Communicator) -> Any:
    """A store every rank of the job reaches, for a failing stage's error (None if none)."""
    store = getattr(world, "_store", None)
    if store is None and dist.is_initialized():
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - backends without a store (mpi)
            return None
    return None if store is None else dist.PrefixStore("fleetlike/pipeline/errors/", store)


class HybridCommunicateGroup:
    """This rank's place among ``dp x pp`` ranks, with Paddle's method names.

    Built collectively by ``fleet.distributed_model`` for a pipelined model (every rank makes
    the same groups in the same order)."""

    def __init__(self, groups: CommGroups, role: Role, dp_degree: int, pp_degree: int, timeout: float,
                 torch_groups: bool = True, p2p: str = "auto") -> None:
        self.groups = groups
        self.role = role
        self.dp_degree, self.pp_degree = resolve_degrees(role.world_size, dp_degree, pp_degree)
        self.global_rank = role.rank
        self.stage_id = role.rank % self.pp_degree
        self.dp_rank = role.rank // self.pp_degree
        # torch's groups carry a pipeline's activations; a plain data-parallel job (a script
        # asking for its data slice) gets none, and torch's world is left to the script
        self._pipe_group: Any = None
        self.p2p = p2p
        #: how this rank's stage hands over to its neighbours, in words (the applied strategy's)
        self.p2p_transport = "none (one stage)"
        if torch_groups:  # formed on the job's store, destroyed with the world (fleet.shutdown)
            device = torch.device("cuda", torch.cuda.current_device()) if groups.world.backend == "nccl" \
                else torch.device("cpu")
            torch_process_group(groups.world, device, purpose="a pipeline's activations", timeout=timeout)
            # every rank decides alike: the machine's support is probed again per pair when the
            # group forms, so a rank that cannot share memory only costs its pairs the rings
            shm = p2p == "auto" and device.type == "cpu" and self.pp_degree > 1
            if shm:
                register_shm()
            for j in range(self.dp_degree):  # every rank creates every pipeline's group, in order
                pg = dist.new_group(self.pipe_ranks(j), timeout=datetime.timedelta(seconds=timeout),
                                    backend=SHM_BACKEND if shm else None)
                if j == self.dp_rank:
                    self._pipe_group = pg
            self.p2p_transport = self._describe_transport(shm, device)
        # named by the shape too: the groups are cached by name, and another shape splits anew
        shape = f"{self.dp_degree}x{self.pp_degree}"
        dp_comm = groups.extra(f"pipeline {shape} dp of stage {self.stage_id}", self.stage_id, self.dp_rank)
        pp_comm = groups.extra(f"pipeline {shape} pp {self.dp_rank}", self.dp_rank, self.stage_id)
        assert dp_comm is not None and pp_comm is not None
        self.dp_comm: Communicator = dp_comm
        self.pp_comm: Communicator = pp_comm
        eps = list(role.endpoints)
        dp_eps = [eps[r] for r in self.data_ranks(self.stage_id)]
        self.dp_role = Role.from_endpoints(self.dp_rank, dp_eps, selected_gpus=role.selected_gpus,
                                           source=role.source, job_id=f"{role.job_id}-pp{self.stage_id}"[:64])
        #: fleetlike's communicators of this stage's data-parallel group (for its gradients)
        self.dp_groups = CommGroups(dp_comm, self.dp_role)

    def _describe_transport(self, shm: bool, device: torch.device) -> str:
        if self.pp_degree == 1:
            return "none (one stage)"
        if device.type != "cpu":
            return f"{self.groups.world.backend} (stages on {device.type})"
        if not shm:
            return "gloo (pipeline_configs.p2p='gloo')"
        local = self._pipe_group.local
        neighbours = [s for s in (self.stage_id - 1, self.stage_id + 1) if 0 <= s < self.pp_degree]
        shared = [s for s in neighbours if s in local]
        if len(shared) == len(neighbours):
            return "shared memory with its neighbour stage(s)"
        why = shm_unsupported() or "not on this machine, or another /dev/shm"
        return (f"shared memory with stage(s) {shared}, gloo with stage(s) "
                f"{[s for s in neighbours if s not in local]} ({why})")

    def pipe_ranks(self, dp_rank: int) -> list[int]:
        """Global ranks of pipeline ``dp_rank``, stage order."""
        return [dp_rank * self.pp_degree + s for s in range(self.pp_degree)]

    def data_ranks(self, stage_id: int) -> list[int]:
        """Global ranks holding stage ``stage_id``, data-parallel order."""
        return [j * self.pp_degree + stage_id for j in range(self.dp_degree)]

    # ---------------------------------------------------------------- Paddle's names

    def get_parallel_mode(self) -> int:
        return ParallelMode.PIPELINE_PARALLEL if self.pp_degree > 1 else ParallelMode.DATA_PARALLEL

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp_degree

    def get_data_parallel_group(self) -> Communicator:
        """fleetlike's communicator of this stage's data-parallel ranks."""
        return self.dp_comm

    def get_data_parallel_group_src_rank(self) -> int:
        return self.data_ranks(self.stage_id)[0]

    def get_stage_id(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pp_degree

    def get_pipe_parallel_group(self) -> Communicator:
        """fleetlike's communicator of this rank's pipeline (stage order)."""
        return self.pp_comm

    def get_pipe_parallel_process_group(self) -> Any:
        """torch's process group of this rank's pipeline (what its `PipelineStage` sends over);
        None when the strategy has no pipeline."""
        return self._pipe_group

    def get_rank_from_stage(self, stage_id: int) -> int:
        return self.dp_rank * self.pp_degree + stage_id

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.pp_degree - 1

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_sharding_parallel_rank(self) -> int:
        return 0

    def get_sharding_parallel_world_size(self) -> int:
        return 1

    def topology(self) -> dict[str, int]:
        return {"data": self.dp_degree, "pipe": self.pp_degree, "model": 1}

    def __repr__(self) -> str:
        return (f"HybridCommunicateGroup(rank={self.global_rank}, dp {self.dp_rank}/{self.dp_degree}, "
                f"stage {self.stage_id}/{self.pp_degree})")

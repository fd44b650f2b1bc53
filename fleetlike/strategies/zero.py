"""ZeRO stage 3 (``sharding_configs.stage = 3``) on FSDP2, and stage 2 where only FSDP2 can run it.

Stage 2 (EPL's ``zero.level = "v1"``) normally runs on the bucket engine of stage 1 with
transient gradient buckets (`fleetlike.strategies.sharding`, `fleetlike.collectives.transient`):
on the CPU FSDP2's copies into and out of its collective buffers and its blocking per-module
collectives made it 0.58x stage 1's steps/s, where the bucket engine moves the same bytes
overlapped with the backward and the update (docs/BENCHMARKS.md). It runs here, on FSDP2, for a
model built as shards (`stage2_on_fsdp2`: the bucket engine keeps whole parameters) and for
offload on a GPU (FSDP2's ``CPUOffloadPolicy``).

torch's FSDP2 (``torch.distributed.fsdp.fully_shard``) already does the per-module work: it
keeps each parameter as a dim-0 shard (a ``DTensor``), all-gathers a module's parameters just
before its forward (prefetching the next module's), reduce-scatters its gradients as backward
produces them, and frees what it gathered. This unit is what fleetlike adds around it:

* **which modules**: `shard_blocks` picks the repeated blocks (every child of a ``ModuleList`` /
  ``Sequential`` whose parameters are its own), each its own FSDP2 unit, and the root takes the
  rest, so a weight tied between the embedding and the head stays one parameter of the root;
* **stage 2 vs 3**: stage 3 frees each block's gathered parameters after its forward and
  gathers them again for its backward (``reshard_after_forward=True``); stage 2 keeps them from
  the forward to the end of the backward (``False``): between steps both hold only shards of
  the parameters, gradients and optimizer state; during the step stage 2 also holds the full
  parameters, and each step moves the bytes of ZeRO-2 (one reduce-scatter of the gradients, one
  all-gather of the parameters) where stage 3 gathers twice;
* **the user's optimizer**: the parameters it was built with are replaced by their shards in
  its ``param_groups`` (state already held, a loaded checkpoint's, is cut into the same
  shards), so any ``torch.optim`` optimizer and LR scheduler steps the shard of every parameter;
* **fleetlike's semantics**: ``gradients_reduce_method`` (FSDP2's divide factor), clipping by
  the global norm over the shards (one scalar allreduce), DDP's ``no_sync`` and gradient merge
  (micro-steps accumulate the shards: FSDP2 reduce-scatters each one, or holds unsharded sums
  inside ``no_sync``), AMP (autocast over fp32 shards; the loss scale unscales the shards, and
  the finite check is agreed over the ranks), ``num_apply_group`` and offload;
* **checks before the first step**: the parameter names, shapes and dtypes agree on every rank
  (a model that differs would shard into pieces of different tensors), the world is not split.

The process group is torch's default group formed on the job's own store
(`fleetlike.comm.torch_group`): FSDP2's traffic is torch's gloo or NCCL on the job's secret
prefix. docs/design.md says why that, not a fleetlike backend.

Example:
    >>> s = DistributedStrategy(sharding=True, sharding_configs={"sharding_degree": 0, "stage": 3,
    ...                                                          "clip_after_allreduce": True})
    >>> model = fleet.distributed_model(net); opt = fleet.distributed_optimizer(torch.optim.AdamW(...), s)
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter  # the interface set_custom_reduce_scatter takes
from torch.distributed.tensor import DTensor, distribute_tensor

from fleetlike.collectives import broadcast_coalesced
from fleetlike.collectives.finite import agree_finite
from fleetlike.comm.torch_group import torch_process_group
from fleetlike.config.choices import REDUCE_METHOD
from fleetlike.program import Op, StepState
from fleetlike.strategies.apply_groups import ApplyGroups
from fleetlike.strategies.sharded_init import is_lazy, materialize, take_pending
from fleetlike.strategies.sharding import _mb, check_degree  # one byte format and degree rule for every stage
from fleetlike.strategies.step import Hook, StepContext, Unit

__all__ = ["AllReduceScatter", "ShardMismatchError", "ShardedParamsUnit", "check_same_model", "full_state_dict", "is_sharded",
           "local", "note_offload", "plain_shards", "shard_blocks", "shard_like", "shard_state_like", "stage2_on_fsdp2",
           "unite_shards"]


log = logging.getLogger("fleetlike")
#: whether a CPU job was told its offload changes nothing (said once per process)
_SAID: list[bool] = []


class ShardMismatchError(ValueError):
    """The ranks hold models that cannot be sharded together."""


def is_sharded(t: Any) -> bool:
    """Whether ``t`` is a shard of a larger tensor (a DTensor of FSDP2)."""
    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's own piece of ``t`` (``t`` itself when it is not sharded)."""
    return t.to_local() if isinstance(t, DTensor) else t


def shard_blocks(model: torch.nn.Module) -> list[str]:
    """Names of the modules FSDP2 shards as units of their own, outermost first: every child
    of a ``ModuleList`` / ``Sequential`` that holds parameters, all of them its own (a parameter
    also reachable from outside the child, a tied weight, keeps the child in its parent)."""
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    chosen: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        if any(name == c or name.startswith(c + ".") for c in chosen):
            continue
        for child, sub in module.named_children():
            full = f"{name}.{child}" if name else child
            params = list(sub.parameters())
            if not params:
                continue
            private = all(all(n.startswith(full + ".") for n in owners[id(p)]) for p in params)
            if private:
                chosen.append(full)
    return chosen


def _signature(model: torch.nn.Module) -> list[str]:
    return [f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in model.named_parameters()]


def check_same_model(world: Any, model: torch.nn.Module) -> None:
    """Raise `ShardMismatchError` on every rank when the ranks' parameter names, shapes or
    dtypes differ (collective: two small all-gathers)."""
    sig = _signature(model)
    count = torch.tensor([len(sig)], dtype=torch.int64, device=world.device)
    counts = [int(c) for c in world.all_gather_flat(count, agreed=True)]
    if len(set(counts)) > 1:
        raise ShardMismatchError(
            f"rank {world.rank}: the ranks' models have different numbers of parameters "
            f"({', '.join(f'rank {r}: {c}' for r, c in enumerate(counts))}); sharding cuts each parameter "
            "into one piece per rank, so every rank must build the same model: build it from the same code "
            "and configuration on every rank")
    digest = torch.tensor([int.from_bytes(hashlib.sha1(s.encode()).digest()[:7], "little") for s in sig] or [0],
                          dtype=torch.int64, device=world.device)
    every = world.all_gather_flat(digest, agreed=True).view(world.size, -1).cpu()
    differ = (every != every[0]).any(0).nonzero()
    if differ.numel():
        i = int(differ[0])
        ranks = [r for r in range(world.size) if bool(every[r, i] != every[world.rank, i])]
        raise ShardMismatchError(
            f"rank {world.rank}: parameter {i} differs between the ranks: here it is {sig[i]!r} (name:shape:dtype), "
            f"ranks {ranks} hold another; sharding cuts each parameter into one piece per rank, so every rank "
            "must build the same model: build it from the same code and configuration on every rank")


class AllReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter as an allreduce of the whole buffer, each rank keeping its chunk.

    gloo's reduce-scatter (torch 2.13, CPU) takes about twice its allreduce of the same buffer
    (the measurement stage 1 rests on, docs/BENCHMARKS.md), so on gloo the allreduce, which moves
    the bytes data parallel moves, is the cheaper way to the same chunk. FSDP2 lays the input
    out rank by rank (``input.view(world, -1)[rank]`` is this rank's), and calls this
    synchronously on the CPU.

    With ``divide`` (the ranks' count, for an average) the chunk is divided as it is copied out,
    and FSDP2 is told to divide by 1 (``set_gradient_divide_factor(1.0)``): gloo has no AVG, so
    FSDP2 would otherwise pass over the chunk once more to divide it; the result is the same
    (the sum, then one division), bit for bit.

    The input, the block's whole gradient, is freed once this rank's chunk is copied out: FSDP2
    keeps a reference to it until the next block's reduce (on a GPU, so that its stream is done
    with it before the memory is reused); on the CPU the call has returned by then, and freeing
    it keeps one block's gradient less in memory through the next block's backward.

    Example:
        >>> module.set_gradient_divide_factor(1.0)
        >>> module.set_custom_reduce_scatter(AllReduceScatter(divide=world_size))   # an average
    """

    def __init__(self, divide: int | None = None) -> None:
        if divide is not None and divide < 1:
            raise ValueError(f"AllReduceScatter: divide={divide}; give the number of ranks (>= 1), or None for a sum")
        self.divide = divide

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        torch.distributed.all_reduce(input_tensor, op=op, group=group)
        chunk = input_tensor.view(group.size(), -1)[group.rank()]
        if self.divide is not None and self.divide != 1:
            torch.div(chunk, self.divide, out=output_tensor)
        else:
            output_tensor.copy_(chunk)
        input_tensor.untyped_storage().resize_(0)  # read by nobody after this; FSDP2 only holds it
        return None


def _offload_policy(cfg: Any, device: torch.device) -> tuple[OffloadPolicy, str | None]:
    """FSDP2's offload policy for the strategy on ``device``, and why offload does not act
    (None when it does)."""
    wanted = bool(cfg["optimize_offload"]) or bool(cfg["offload_params"])
    if not wanted:
        return OffloadPolicy(), "off"
    if device.type != "cuda":
        return OffloadPolicy(), (f"this job runs on the {device.type}: the parameter shards, gradients and "
                                 "optimizer state already live in host memory, so there is nothing to move")
    return CPUOffloadPolicy(pin_memory=True), None


def note_offload(ctx: StepContext, why: str | None) -> None:
    """Record whether offload acts (``why`` None: it does; "off": not asked for), and warn once
    per process when it was asked for and changes nothing."""
    if why == "off":
        return
    ctx.record("sharding_configs.optimize_offload", why is None,
               "optimizer state, update and parameter shards in pinned host memory (FSDP2's CPUOffloadPolicy)"
               if why is None else why)
    if why is not None and not _SAID:
        _SAID.append(True)  # once per process, however many models
        log.warning("sharding_configs offload changes nothing: %s", why)


def stage2_on_fsdp2(ctx: StepContext) -> str | None:
    """Why a stage 2 job runs on FSDP2 rather than on the bucket engine (None: it runs on the
    bucket engine, `fleetlike.strategies.sharding`): a model built as shards, which the bucket
    engine would have to build whole on every rank, or offload on a GPU, which is FSDP2's
    ``CPUOffloadPolicy``."""
    if is_lazy(ctx.model):
        return "the model was built as shards (sharded construction or the meta device), which FSDP2 fills shard by shard"
    if _offload_policy(ctx.strategy.sharding_configs, ctx.device)[1] is None:
        return "offload moves the optimizer state and update to host memory through FSDP2's CPUOffloadPolicy"
    return None


class ShardedParamsUnit(Unit):
    """Stages 2 and 3 in both styles (see the module docstring)."""

    name = "sharding"
    needs_optimizer = True

    def __init__(self, ctx: StepContext, *, amp: bool) -> None:
        s = ctx.strategy
        cfg = s.sharding_configs
        world = ctx.groups.world
        check_degree(cfg, world.size, "parameters, gradients and optimizer state")
        self.ctx = ctx
        self.stage = int(cfg["stage"])
        self.clip_norm = float(cfg["clip_norm"])
        self.n_groups = int(s.num_apply_group)
        self.world = world
        model = ctx.model
        if any(isinstance(m, FSDPModule) for m in model.modules()):
            raise ValueError("strategy.sharding stage 2/3 shards the model itself, but it already holds "
                             "fully_shard modules; pass the plain model")
        check_same_model(world, model)
        #: built as shards (fleet.sharded_init or the meta device): this rank's pieces, by name
        self.lazy = is_lazy(model)
        pending = take_pending(model, world) if self.lazy else None
        # every rank shards rank 0's values (the eager style broadcast them already; the
        # program style's startup cannot broadcast shards, so it happens here, once, whole);
        # a model built as shards was checked to hold the same values on every rank instead
        broadcast_coalesced(world, ([] if self.lazy else [p.data for p in model.parameters()]) + list(model.buffers()))
        self.names = {id(p): n for n, p in model.named_parameters()}
        before = {n: p for n, p in model.named_parameters()}
        full_bytes = sum(p.numel() * p.element_size() for p in before.values())
        pg = torch_process_group(world, ctx.device)
        self.mesh = DeviceMesh.from_group(pg, ctx.device.type)
        offload, self.offload_why = _offload_policy(cfg, ctx.device)
        reshard = self.stage == 3
        self.blocks = shard_blocks(model)
        modules = dict(model.named_modules())
        for name in reversed(self.blocks):  # innermost first, as FSDP2 wants
            fully_shard(modules[name], mesh=self.mesh, reshard_after_forward=reshard, offload_policy=offload)
        fully_shard(model, mesh=self.mesh, reshard_after_forward=reshard, offload_policy=offload)
        if pending is not None:  # only now are this rank's shards allocated, and filled from its pieces
            materialize(model, world, ctx.device, pending)
        self.fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]
        op = REDUCE_METHOD.op(cfg["gradients_reduce_method"])
        self.via_allreduce = ctx.device.type != "cuda" and torch.distributed.get_backend(pg) == "gloo"
        average = op.value == "avg"
        for m in self.fsdp:
            if ctx.device.type != "cuda":
                m.set_force_sum_reduction_for_comms(True)  # gloo has neither AVG nor PREMUL_SUM
            if self.via_allreduce:  # an average divided as each chunk is copied out, not by FSDP2 after
                m.set_custom_reduce_scatter(AllReduceScatter(divide=world.size if average else None))
            if not average or self.via_allreduce:
                m.set_gradient_divide_factor(1.0)  # a sum over the ranks (or divided by AllReduceScatter)
        after = dict(model.named_parameters())
        #: the model's parameters before sharding -> their shards (by id of the former)
        self.replaced = {id(p): after[n] for n, p in before.items()}
        self._sync: bool | None = None
        self.groups: ApplyGroups | None = None
        largest = max((sum(p.numel() * p.element_size() for p in modules[b].parameters()) for b in self.blocks),
                      default=full_bytes)
        mine = sum(local(p).numel() * p.element_size() for p in after.values())
        root_only = len(self.blocks) == 0
        ctx.record("sharding", True, (
            f"stage {self.stage} on torch's FSDP2 over {world.size} ranks: parameters"
            + (", " if self.stage == 3 else " (between steps), ")
            + f"gradients and optimizer state sharded; this rank holds {_mb(mine)} of {_mb(full_bytes)} of "
            f"parameters; {len(self.blocks)} blocks sharded on their own"
            + (" (no ModuleList/Sequential of blocks: the whole model is one unit, gathered at once)" if root_only else
               f" (largest {_mb(largest)}), the rest with the root")
            + ("; each block gathered for its forward and again for its backward, freed after" if self.stage == 3 else
               "; parameters gathered for the forward and kept to the end of the backward")
            + ("; built as shards (sharded construction or the meta device): no rank held the model whole"
               if self.lazy else "")
            + f"; gradients reduce-scattered per block during backward, {cfg['gradients_reduce_method']}"
            + ("; on gloo as an allreduce of which each rank keeps its chunk (gloo's reduce_scatter is slower)"
               if self.via_allreduce else "")
            + (f", clipped to global norm {self.clip_norm:g} over the shards" if self.clip_norm > 0 else "")))
        ctx.record("data_parallel", False, f"replaced by sharding stage {self.stage}")
        note_offload(ctx, self.offload_why)
        if s.check_nan_inf and not amp:
            ctx.record("check_nan_inf", False, "stages 2 and 3 reduce-scatter inside FSDP2's backward; "
                       "the gradient shards are checked before the update instead")
        self.check_nan = bool(s.check_nan_inf) and not amp

    # ------------------------------------------------------------------ binding

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        if type(optimizer).__name__ == "LBFGS":
            raise ValueError("strategy.sharding cannot drive LBFGS: it re-evaluates the whole model in a closure "
                             "and keeps one state for all parameters; use another optimizer or turn sharding off")
        self.adopt(optimizer)
        if self.n_groups > 1 or self.groups is None:
            self.groups = ApplyGroups(optimizer, self.n_groups)
            if self.n_groups > 1:
                self.ctx.record("num_apply_group", True, f"each rank's shard updated in {self.n_groups} groups of "
                                f"{', '.join(str(len(g)) for g in self.groups.groups)} parameters")

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """Replace the model's former parameters in ``optimizer`` by their shards; state it
        already holds for them (a loaded full state) is cut into the same shards."""
        for group in optimizer.param_groups:
            group["params"] = [self.replaced.get(id(p), p) for p in group["params"]]
        moved = [(p, self.replaced[id(p)]) for p in list(optimizer.state) if id(p) in self.replaced]
        for old, new in moved:
            state = optimizer.state.pop(old)
            optimizer.state[new] = {k: shard_like(v, new) for k, v in state.items()}

    def drop_foreign_state(self, optimizer: torch.optim.Optimizer) -> None:
        """After a full (consolidated) optimizer state was loaded: keep this rank's shard of
        every state tensor (what stage 1 does by dropping the other ranks' parameters)."""
        for p, st in optimizer.state.items():
            if isinstance(p, DTensor):
                for k, v in list(st.items()):
                    st[k] = shard_like(v, p)

    def layout(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The checkpoint manifest's entry: every rank holds a dim-0 shard of every state tensor."""
        return {"world_size": self.world.size, "stage": self.stage, "dim0_shards": True}

    # ------------------------------------------------------------------ hooks

    def hooks(self) -> list[Hook]:
        hooks = [
            Hook("before_backward", "arm", self._arm,
                 {"overlap": "each block's gradients reduce-scattered as backward produces them (FSDP2)"}, listed=False),
            Hook("synchronize", "c_reducescatter_grads", self._wait,
                 {"blocks": len(self.blocks) + 1, "world": self.world.size, "stage": self.stage}),
        ]
        if self.clip_norm > 0:
            hooks.append(Hook("before_update", "clip_by_global_norm", self._clip,
                              {"clip_norm": self.clip_norm, "over": "all shards (one scalar allreduce)"}))
        elif self.check_nan:
            hooks.append(Hook("before_update", "check_finite_shards", self._check_finite, {}))
        return hooks

    def _arm(self, st: StepState) -> None:
        want = bool(st.communicate)
        if self._sync is not want:  # DDP's no_sync: FSDP2 keeps the unsharded sum until a synced backward
            self.fsdp[-1].set_requires_gradient_sync(want)
            self._sync = want

    def _wait(self, st: StepState) -> None:
        # FSDP2 waits for its reduce-scatters at the end of backward (root's final callback); per
        # unit: a gather for the forward, one more for the backward at stage 3, a reduce-scatter
        st.info["collectives"] = (3 if self.stage == 3 else 2) * len(self.fsdp)

    def _shards(self) -> list[torch.Tensor]:
        return [local(p.grad) for p in self.ctx.model.parameters() if p.grad is not None]

    def _clip(self, st: StepState) -> None:
        if st.accumulate or st.skip_update:
            return
        grads = self._shards()
        sq = torch.zeros(1, dtype=torch.float64, device=self.world.device)
        for g in grads:
            sq += g.detach().double().pow(2).sum().to(sq.device)
        self.world.all_reduce(sq, "sum", agreed=True)
        norm = math.sqrt(float(sq.item()))
        st.info["grad_norm"] = norm
        coef = min(1.0, self.clip_norm / (norm + 1e-6))
        for g in grads:
            g.mul_(coef)

    def _check_finite(self, st: StepState) -> None:
        if st.accumulate or st.skip_update:
            return
        # every rank holds a shard of every parameter, so the order of named_parameters is shared
        named = list(self.ctx.model.named_parameters())
        bad = [i for i, (_, p) in enumerate(named) if p.grad is not None and not bool(torch.isfinite(local(p.grad)).all())]
        agree_finite(self.world, bad, lambda i: named[i][0], "after the reduce-scatter (a rank's own gradient "
                     "spreads to every shard it is summed into)", what="the reduced gradient shards")

    def run_update(self, st: StepState, step: Callable[[], Any]) -> Any:
        if self.groups is None:
            return step()
        return self.groups.run(step)

    # ------------------------------------------------------------------ state

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The model's parameters and buffers at full size under its own names (collective)."""
        return full_state_dict(self.ctx.model, rank0_only, self.world.rank)

    def described_ops(self) -> list[Op]:
        op = "avg" if REDUCE_METHOD.op(self.ctx.strategy.sharding_configs["gradients_reduce_method"]).value == "avg" \
            else "sum"
        return [Op(f"c_reducescatter_{op}", None, {"block": name or "(root)", "via": "FSDP2"}, parent="backward")
                for name in [*self.blocks, ""]]


def shard_like(value: Any, param: torch.Tensor) -> Any:
    """``value``, a full-size tensor of ``param``'s shape, cut into this rank's piece of it as
    ``param`` is (no communication: every rank holds the same full value); anything else as is."""
    if (isinstance(param, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
            and tuple(value.shape) == tuple(param.shape)):
        return distribute_tensor(value.to(local(param).device), param.device_mesh, param.placements,
                                 src_data_rank=None)
    return value


def shard_state_like(model: torch.nn.Module, saved: dict[str, Any]) -> dict[str, Any]:
    """A full state_dict (a consolidated checkpoint's) cut into ``model``'s shards where its
    entries are sharded, so ``model.load_state_dict`` takes it at any stage."""
    now = model.state_dict()
    return {k: shard_like(v, now[k]) if k in now else v for k, v in saved.items()}


def plain_shards(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state_dict with each sharded tensor as this rank's plain piece (what
    ``torch.load(weights_only=True)`` reads back), its full shape under ``"dim0_shards"``."""
    shapes: dict[Any, dict[str, list[int]]] = {}
    out = dict(state)
    out["state"] = {}
    for index, st in state["state"].items():
        entry = {}
        for k, v in st.items():
            if isinstance(v, DTensor):
                shapes.setdefault(index, {})[k] = list(v.shape)
                v = v.to_local().detach().clone()
            entry[k] = v
        out["state"][index] = entry
    if shapes:
        out["dim0_shards"] = shapes
    return out


def unite_shards(shards: list[dict[str, Any]]) -> dict[Any, Any]:
    """The full per-parameter state from every rank's `plain_shards` (rank order): each sharded
    tensor is its pieces joined along dim 0; the rest is rank 0's."""
    shapes = shards[0].get("dim0_shards", {})
    state: dict[Any, Any] = {}
    for index, st in shards[0]["state"].items():
        entry = dict(st)
        for k, shape in shapes.get(index, {}).items():
            entry[k] = torch.cat([s["state"][index][k].reshape(-1, *shape[1:]) for s in shards]).reshape(shape)
        state[index] = entry
    return state


def full_state_dict(model: torch.nn.Module, rank0_only: bool = False, rank: int = 0) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every shard gathered to its full tensor (collective over the
    shards' ranks when any is sharded); plain tensors, detached copies. With ``rank0_only``
    ranks other than 0 return ``{}``, keeping no gathered tensor longer than its gather."""
    if is_lazy(model):
        raise ValueError("full_state_dict: the model was built as shards (fleet.sharded_init() or the meta device) "
                         "and is not materialised yet; wrap it with fleet.distributed_model and pass the wrapped model")
    keep = not rank0_only or rank == 0
    out: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if keep:
            out[name] = value.detach().clone() if isinstance(value, torch.Tensor) else value
    return out

"""``import fleetlike.auto``: every DDP model of this process averages its gradients through fleetlike.

(This module is `fleetlike.ddp.auto`; ``fleetlike.auto`` is the same module under its documented name.)

Put the import before the script's own imports (or start the job with
``python -m fleetlike.launch --accelerate_ddp``, which does it for every worker). From then on each
``torch.nn.parallel.DistributedDataParallel(...)`` built in the process gets `fleetlike_hook` with
the strategy the environment describes (`fleetlike.ddp.knobs`: ``FLEETLIKE_STRATEGY`` plus the
``FLEETLIKE_ALLREDUCE_*`` ... knobs), and nothing else in the script changes:

* the settings are read and checked at import: an unknown ``FLEETLIKE_*`` variable or a bad
  value ends the process at once with the variable, the value and the accepted values;
* each DDP model meets fleetlike's communicators over the model's own ``process_group`` (the
  default group, a subgroup, or a ``device_mesh``'s), through the store of the script's own
  ``init_process_group`` (`fleetlike.ddp.world`): the job is the one the script formed, however
  it was started (torchrun, ``mp.spawn``, ``tcp://`` / ``file://``, mpiexec, Slurm, fleetlike's
  launcher), and nothing else binds a port; a group fleetlike cannot meet raises there, with
  the reason; rank 0 prints the applied settings once;
* a script that registers its own comm hook (``ddp.register_comm_hook``) gets it: fleetlike's
  hook steps aside for that model, saying so in one line (`fleetlike.ddp.slot`);
* the divergence guard (`fleetlike.collectives.divergence`) compares the ranks' parameters
  when the model is wrapped (after DDP's broadcast from rank 0) and every
  ``FLEETLIKE_DIVERGENCE_CHECK_N_STEPS`` backward passes (default 200, 0 = only at the wrap):
  ranks that differ stop on every rank, naming the first differing parameter;
* ``FLEETLIKE_FUSION_MB`` becomes DDP's ``bucket_cap_mb`` where the script does not pass one;
* ``FLEETLIKE_ACCUMULATE_N_STEPS=k``: DDP communicates every k-th backward; the ``step()`` and
  ``zero_grad()`` of the optimizers over that model's parameters do nothing after the other
  backward passes, so an unchanged loop trains with k times the batch (AIACC's meaning).

Example (the first line of train.py is ``import fleetlike.auto``):
    $ FLEETLIKE_ALLREDUCE_MODE=hierarchical FLEETLIKE_ALLREDUCE_DTYPE=fp16 torchrun --nproc_per_node=2 train.py
    $ FLEETLIKE_ALLREDUCE_DTYPE=fp16 python -m fleetlike.launch --nproc_per_node=2 --accelerate_ddp train.py
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import types
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from fleetlike.collectives.divergence import DivergenceGuard
from fleetlike.comm import CommGroups
from fleetlike.config import DistributedStrategy, envvars
from fleetlike.ddp import FleetHookState, KnobError, applied_knobs, strategy_from_env
from fleetlike.config.knobs import knob_options
from fleetlike.ddp.slot import HookSlot, attach
from fleetlike.ddp.world import groups_for, model_group
from fleetlike.roles.settings import every_from_env

__all__ = ["settings", "install", "uninstall"]

_LOCK = threading.Lock()
_ORIGINAL_DDP_INIT = DistributedDataParallel.__init__
_ORIGINAL_OPT_INIT = torch.optim.Optimizer.__init__
_DDP_SIGNATURE = inspect.signature(_ORIGINAL_DDP_INIT)


class _Settings:
    """What the environment asked for, communicators given by hand (``groups``: else each model
    meets its own group), and the states of the DDP models built so far (by parameter id, for
    the accumulation gate)."""

    def __init__(self, strategy: DistributedStrategy, knobs: Mapping[str, str], every: int | None) -> None:
        self.strategy = strategy
        self.every = every  # divergence guard period, in backward passes
        self.knobs = dict(knobs)
        #: a knob sized the buckets (FLEETLIKE_FUSION_MB, PERSEUS_ALLREDUCE_FUSION,
        #: TIACC_TRAINING_FUSION_THRESHOLD): DDP's bucket_cap_mb follows, unless the script gives one
        self.sizes_buckets = bool({"fuse_grad_size_in_MB", "fuse_grad_max_buckets"} & set(knob_options(self.knobs)))
        self.groups: CommGroups | None = None
        self.printed = False
        self.by_param: weakref.WeakValueDictionary[int, FleetHookState] = weakref.WeakValueDictionary()

    def connect(self, model: DistributedDataParallel, device: torch.device | None = None) -> CommGroups:
        """The communicators of ``model``'s process group (a backend for its ``device``: NCCL
        for a model on a GPU, so its CUDA buckets are not refused by gloo)."""
        if self.groups is not None:
            return self.groups
        return groups_for(model_group(model), device)


_SETTINGS: _Settings | None = None


def settings() -> _Settings:
    """The settings `install` read (installing on first use)."""
    if _SETTINGS is None:
        install()
    assert _SETTINGS is not None
    return _SETTINGS


def install(environ: Mapping[str, str] | None = None) -> None:
    """Read the knobs and patch DDP and the optimizers (what the import does); KnobError on bad
    settings. Calling it again re-reads the environment."""
    global _SETTINGS
    env = os.environ if environ is None else environ
    strategy = strategy_from_env(env)
    FleetHookState(strategy)  # refuses what a hook cannot run (amp, sharding, ...) now, not later
    with _LOCK:
        _SETTINGS = _Settings(strategy, applied_knobs(env), every_from_env(env))
    DistributedDataParallel.__init__ = _ddp_init  # type: ignore[method-assign]
    torch.optim.Optimizer.__init__ = _optimizer_init  # type: ignore[method-assign]


def uninstall() -> None:
    """Undo `install` (models already built keep their hook)."""
    global _SETTINGS
    DistributedDataParallel.__init__ = _ORIGINAL_DDP_INIT  # type: ignore[method-assign]
    torch.optim.Optimizer.__init__ = _ORIGINAL_OPT_INIT  # type: ignore[method-assign]
    _SETTINGS = None


@functools.wraps(_ORIGINAL_DDP_INIT)
def _ddp_init(self: DistributedDataParallel, *args: Any, **kwargs: Any) -> None:
    cfg = settings()
    bound = _DDP_SIGNATURE.bind(self, *args, **kwargs)
    if "bucket_cap_mb" not in bound.arguments and cfg.sizes_buckets:
        module = bound.arguments.get("module")
        cap = cfg.strategy.bucket_cap_bytes(module.parameters() if isinstance(module, torch.nn.Module) else None)
        kwargs["bucket_cap_mb"] = float(cfg.strategy.fuse_grad_size_in_MB) if cap is None else cap / (1 << 20)
    _ORIGINAL_DDP_INIT(self, *args, **kwargs)
    if self._comm_hooks:  # DDP's own mixed precision registered a hook already: it stays
        print("fleetlike.auto: this DDP model already has a comm hook (DDP's mixed precision); "
              "fleetlike's hook steps aside for it", file=sys.stderr, flush=True)
        return
    device = next((p.device for p in self.parameters()), None)
    state = FleetHookState(cfg.strategy, groups=cfg.connect(self, device), model=self)
    if cfg.knobs.get(envvars.ALLREDUCE_MODE, "").strip().lower() == "hierarchical":
        for name, applied, why in state.notes:
            if name == "use_hierarchical_allreduce" and not applied:
                raise KnobError(f"FLEETLIKE_ALLREDUCE_MODE=hierarchical cannot run here: {why}; "
                                "use auto (two-level where it helps, else flat) or flat")
    slot = attach(self, state, on_replace=functools.partial(_stepped_aside, cfg, self))
    assert state.groups is not None
    guard_comm = state.groups.extra("ddp divergence guard", 0, state.groups.world.rank)
    assert guard_comm is not None
    slot.guard = DivergenceGuard(guard_comm, self.module.named_parameters(), every=cfg.every, what="DDP")
    slot.guard.check("when the DDP model was built, after its broadcast from rank 0")
    for p in self.parameters():
        cfg.by_param[id(p)] = state
    _print_once(cfg, state)


def _stepped_aside(cfg: _Settings, model: DistributedDataParallel, slot: HookSlot) -> None:
    """The script's own hook took the model: its optimizers are no longer gated, and the
    replaced state's helper threads stop."""
    for state in {id(s): s for s in (cfg.by_param.pop(id(p), None) for p in model.parameters()) if s}.values():
        state.close()


def _print_once(cfg: _Settings, state: FleetHookState) -> None:
    if cfg.printed or state.role is None:
        return
    cfg.printed = True
    if state.role.rank != 0:
        return
    knobs = ", ".join(f"{k}={v}" for k, v in cfg.knobs.items()) or "none"
    lines = [f"fleetlike.auto: DDP gradients through fleetlike ({state.role.world_size} ranks, "
             f"{state.role.node_num} node(s)); knobs: {knobs}"]
    changed = cfg.strategy.to_dict(flat=True, non_default_only=True)
    lines.append("  strategy: " + (", ".join(f"{k}={v}" for k, v in changed.items()) or "defaults (flat fp32)"))
    for name, applied, why in state.notes:
        lines.append(f"  {name}: {'applied' if applied else 'NOT applied'}: {why}")
    print("\n".join(lines), file=sys.stderr, flush=True)


def _gate(fn: Any) -> Any:
    """``optimizer.step`` / ``zero_grad`` that do nothing after a backward pass that only
    accumulated (`FleetHookState.communicating` False); a bound method, as LR schedulers expect."""

    @functools.wraps(fn)
    def gated(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        state = _state_of(self)
        if state is not None and state.accumulate > 1 and state.passes and not state.communicating:
            return None
        return fn(self, *args, **kwargs)

    return gated


def _state_of(opt: torch.optim.Optimizer) -> FleetHookState | None:
    cfg = _SETTINGS
    if cfg is None:
        return None
    for group in opt.param_groups:
        for p in group["params"]:
            state = cfg.by_param.get(id(p))
            if state is not None:
                return state
    return None


@functools.wraps(_ORIGINAL_OPT_INIT)
def _optimizer_init(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
    _ORIGINAL_OPT_INIT(self, *args, **kwargs)
    if _SETTINGS is not None and _SETTINGS.strategy.gradient_merge:
        for name in ("step", "zero_grad"):
            method = getattr(type(self), name)
            setattr(self, name, types.MethodType(_gate(method), self))


try:
    install()
except (KnobError, ValueError, TypeError) as exc:
    # a bad setting stops the script before it trains on settings nobody asked for
    raise SystemExit(f"fleetlike.auto: {exc}") from None

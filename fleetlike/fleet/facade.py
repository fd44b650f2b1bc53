"""The `Fleet` facade of API.md section 4: thin, delegating to roles, comm and strategies.

It holds what a process needs between calls (its `FleetContext`, the wrapped models and
optimizers, objects registered for checkpoints) and no training logic of its own: the strategy
engine (`fleetlike.strategies.engine`) does the work in both styles.

Example (the four steps, program style):
    >>> from fleetlike import fleet, DistributedStrategy, roles     # 1. import
    >>> fleet.init(roles.PaddleCloudRoleMaker(is_collective=True))  # 2. roles + strategy
    >>> opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    >>> opt.minimize(loss_fn, model)
    >>> exe = fleetlike.Executor(fleet.device())                     # 3. train
    >>> exe.run(fleet.startup_program)
    >>> exe.run(fleet.main_program, feed=batch, fetch_list=["loss"])
    >>> if fleet.is_first_worker(): fleet.save_persistables(exe, "ckpt")   # 4. save

Eager style (a plain PyTorch loop):
    >>> with fleet.session(strategy=strategy):
    ...     model = fleet.distributed_model(model)
    ...     opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ...     for x, y in loader:
    ...         opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step()
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from fleetlike.collectives import broadcast_coalesced
from fleetlike.comm import DEFAULT_TIMEOUT, CommGroups, Communicator, create_world
from fleetlike.comm.cuda import selected_gpu, use_device
from fleetlike.config import DistributedStrategy
from fleetlike.fleet import checkpoint as ckpt
from fleetlike.fleet.context import FleetContext
from fleetlike.fleet.model import DistributedModel
from fleetlike.fleet.optimizer import DistributedOptimizer
from fleetlike.fleet.util import Util
from fleetlike.fleet.mixed_precision import DecoratedOptimizer
from fleetlike.program import Executor, Program
from fleetlike.roles import Role, RoleMaker, as_role
from fleetlike.roles.settings import EnvSettings, env_settings, strategy_with_env, with_epl_env
from fleetlike.strategies.amp import AmpUnit, autocast as amp_autocast
from fleetlike.strategies.engine import Engine, build_engine
from fleetlike.strategies.sharded_init import sharded_init
from fleetlike.strategies.step import AppliedEntry
from fleetlike.strategies.zero import full_state_dict

__all__ = ["Fleet", "fleet", "load_inference_model"]

load_inference_model = ckpt.load_inference_model


#: launchers whose ranks get GPU ``local_rank`` by default (their scripts assume it, as DDP's
#: and Horovod's do); fleetlike's/Paddle's launcher says which GPU itself, and a `Role` built by
#: hand (``UserDefinedRoleMaker``, tests) stays on the CPU unless a GPU is named
_GPU_BY_LOCAL_RANK = frozenset({"torchrun", "openmpi", "mpich", "slurm", "single"})


def _device_for(role: Role, env: EnvSettings, backend: str | None = None) -> torch.device:
    """This rank's device: its selected GPU, else the CPU.

    A GPU is selected by ``FLAGS_selected_gpus`` (fleetlike's and Paddle's launchers), by
    ``CUDA_VISIBLE_DEVICES``, by asking for NCCL, or, where CUDA is available, by being started
    by torchrun, mpirun, Slurm or a plain ``python`` (GPU ``local_rank % device_count``, as DDP
    and Horovod scripts assume: before, such a rank trained on the CPU). fleetlike's launcher
    with ``--nproc_per_node`` and no GPUs, and a role built by hand, stay on the CPU; a CPU
    backend (``backend`` / ``FLEETLIKE_BACKEND`` gloo or mpi, which move CPU tensors only) or
    ``CUDA_VISIBLE_DEVICES=`` asks for the CPU anywhere.
    """
    chosen = (backend or env.backend or "auto").lower()
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0 or chosen in ("gloo", "mpi"):
        return torch.device("cpu")
    if role.selected_gpus:  # the rule the NCCL communicator follows: the id at the local rank
        return torch.device("cuda", selected_gpu(role.selected_gpus, role.local_rank, role.rank))
    if env.cuda_visible_devices or role.source in _GPU_BY_LOCAL_RANK or chosen == "nccl":
        return torch.device("cuda", role.local_rank % count)
    return torch.device("cpu")


def _visible(role: Role, ids: tuple[int, ...], backend: str | None) -> Role:
    """``role`` on the GPUs of ``strategy.visible_devices`` (EPL's ``cluster.run_visible_devices``):
    local rank i on the i-th id, as ``FLAGS_selected_gpus`` (the NCCL communicator follows it)."""
    field = "strategy.visible_devices (EPL's cluster.run_visible_devices)"
    if not torch.cuda.is_available() or (backend or "").lower() in ("gloo", "mpi"):
        raise ValueError(f"{field}={list(ids)} names GPUs, but this process trains on the CPU (no CUDA device, "
                         "or a CPU backend); leave it empty")
    if role.local_size > len(ids) and len(ids) != 1:
        raise ValueError(f"{field}={list(ids)} has {len(ids)} GPU(s) for the {role.local_size} ranks of this "
                         "node; give one id per local rank")
    return dataclasses.replace(role, selected_gpus=tuple(ids))


class Fleet:
    """Process-wide entry point; use the module-level ``fleet`` instance."""

    def __init__(self) -> None:
        self._ctx: FleetContext | None = None
        self._models: list[DistributedModel] = []
        self._optimizers: list[DistributedOptimizer] = []
        self._registered: dict[str, Any] = {}
        #: pipelined models (strategy.pipeline) and their dp x pp groups
        self._pipelines: list[Any] = []
        self._hcg: Any = None
        self.util = Util(self._util_comm)

    # ------------------------------------------------------------------ init and roles

    def init(
        self,
        role_maker: RoleMaker | Role | None = None,
        is_collective: bool = True,
        strategy: DistributedStrategy | None = None,
        timeout: float | None = None,
        check_collectives: bool = False,
        *,
        backend: str | None = None,
    ) -> None:
        """Set up this process's communicators. ``role_maker=None`` auto-detects the launch.

        Calling it again needs `shutdown` first (or use `session`): the communicators of a
        running job cannot be replaced under the models and optimizers that use them."""
        if is_collective is not True:
            raise ValueError(
                "fleet.init(is_collective=False) asks for parameter-server mode, which fleetlike "
                "does not provide; use is_collective=True (collective training)"
            )
        if self._ctx is not None:
            raise RuntimeError(
                "fleet.init() was already called in this process; call fleet.shutdown() first to "
                "re-initialise (or use `with fleet.session(...):`, which shuts down at the end)"
            )
        env = env_settings()
        if strategy is not None and not isinstance(strategy, DistributedStrategy):
            raise TypeError(f"fleet.init: strategy must be a DistributedStrategy, got {type(strategy).__name__}")
        role = as_role(role_maker)
        devices = with_epl_env(strategy).visible_devices  # EPL_CLUSTER_RUN_VISIBLE_DEVICES too
        if devices:
            role = _visible(role, devices, backend or env.backend)
        device = _device_for(role, env, backend)
        use_device(device)  # once, here: every later CUDA call of this rank lands on its GPU
        limit = DEFAULT_TIMEOUT if timeout is None else timeout
        world = create_world(role, backend=backend or env.backend or "auto", timeout=limit, device=device)
        world.timeout = limit
        world.check_collectives = bool(check_collectives or env.check_collectives)
        self._ctx = FleetContext(role, world, CommGroups(world, role), device, strategy or DistributedStrategy(), limit)

    def replace_world(self, role: Role, world: Communicator, *, strategy: DistributedStrategy | None = None,
                      timeout: float | None = None) -> None:
        """Run on ``world`` (rank and size of ``role``) from now on, keeping the wrapped models
        and optimizers: their engines are dropped (gradient hooks removed) and rebuilt on the new
        communicators, programs are rebuilt in place. Without ``init`` before, it is ``init``
        with a world built elsewhere. `fleetlike.elastic` calls it when the membership changed;
        the state (parameters, the strategy's counters) is the caller's to restore after."""
        old = self._ctx
        limit = (old.timeout if old is not None else DEFAULT_TIMEOUT) if timeout is None else timeout
        chosen = strategy or (old.strategy if old is not None else DistributedStrategy())
        device = old.device if old is not None else _device_for(role, env_settings())
        if old is not None:
            for engine in self._engines():
                if engine.ctx.reducer is not None:
                    engine.ctx.reducer.remove()
            old.groups.close()
        world.timeout = limit
        self._ctx = FleetContext(role, world, CommGroups(world, role), device, chosen, limit)
        for model in self._models:
            model.drop_engine()
        for opt in self._optimizers:
            opt.rebind(self._ctx)

    def shutdown(self) -> None:
        """Close the communicators (also done at exit). ``init`` may be called again after."""
        if self._ctx is not None:
            self._ctx.groups.close()
        self._ctx = None
        self._models, self._optimizers, self._registered = [], [], {}
        self._pipelines, self._hcg = [], None

    @contextlib.contextmanager
    def session(self, role_maker: RoleMaker | Role | None = None, **init_kwargs: Any) -> Iterator[Fleet]:
        """``init`` now, ``shutdown`` guaranteed at the end (an error inside included)."""
        self.init(role_maker, **init_kwargs)
        try:
            yield self
        finally:
            self.shutdown()

    @property
    def initialized(self) -> bool:
        """Whether ``init`` was called in this process (and not shut down since)."""
        return self._ctx is not None

    def context(self) -> FleetContext:
        """What ``init`` set up (role, world, groups, device, strategy), for the other faces
        built on the same communicators (``fleetlike.horovod``)."""
        return self._context("fleet.context()")

    def _context(self, what: str) -> FleetContext:
        if self._ctx is None:
            raise RuntimeError(f"{what} needs fleet.init() first (step 2 of the four steps)")
        return self._ctx

    @property
    def role(self) -> Role:
        return self._context("fleet.role").role

    def worker_num(self) -> int:
        return self.role.world_size

    def worker_index(self) -> int:
        return self.role.rank

    def worker_endpoints(self, to_string: bool = False) -> list[str] | str:
        eps = list(self.role.endpoints)
        return ",".join(eps) if to_string else eps

    def is_first_worker(self) -> bool:
        return self.role.rank == 0

    def local_rank(self) -> int:
        return self.role.local_rank

    def local_size(self) -> int:
        return self.role.local_size

    def node_num(self) -> int:
        return self.role.node_num

    def node_index(self) -> int:
        return self.role.node_index

    def device(self) -> torch.device:
        """This process's device: its selected GPU, else the CPU."""
        return self._context("fleet.device()").device

    def barrier_worker(self) -> None:
        self._context("fleet.barrier_worker()").world.barrier()

    def _util_comm(self) -> tuple[Communicator, int, int, torch.device]:
        ctx = self._context("fleet.util")
        return ctx.world, ctx.role.rank, ctx.role.world_size, ctx.device

    # ------------------------------------------------------------------ strategy

    def effective_strategy(self, explicit: DistributedStrategy | None = None, what: str = "fleet") -> DistributedStrategy:
        """The strategy a wrapper built now runs: ``explicit`` or init's, with ``FLEETLIKE_STRATEGY``
        and the environment knobs applied and the combination checked (what `distributed_optimizer` uses; also the Horovod
        face's `DistributedOptimizer`)."""
        return self._strategy(explicit, what)

    def _strategy(self, explicit: DistributedStrategy | None, what: str) -> DistributedStrategy:
        """The strategy a wrapper runs: its own or init's, with FLEETLIKE_STRATEGY and the knobs
        (``FLEETLIKE_*``, ``PERSEUS_*``, ``TIACC_*``, ``LIGHT_*``) applied."""
        ctx = self._context(what)
        if explicit is not None and not isinstance(explicit, DistributedStrategy):
            raise TypeError(f"{what}: strategy must be a DistributedStrategy, got {type(explicit).__name__}")
        return strategy_with_env(explicit or ctx.strategy)

    # ------------------------------------------------------------------ optimizer and programs

    def distributed_optimizer(
        self, optimizer: torch.optim.Optimizer, strategy: DistributedStrategy | None = None
    ) -> DistributedOptimizer:
        """Wrap ``optimizer`` with ``strategy`` (default: the one given to ``fleet.init``)."""
        ctx = self._context("fleet.distributed_optimizer")
        amp_configs = None
        if isinstance(optimizer, DecoratedOptimizer):  # seed 003's mixed_precision.decorate
            amp_configs, optimizer = optimizer.amp_configs, optimizer.optimizer
        chosen = self._strategy(strategy, "fleet.distributed_optimizer")
        if amp_configs is not None:
            chosen.amp = True
            chosen.amp_configs = amp_configs
        opt = DistributedOptimizer(optimizer, chosen, ctx)
        opt.explicit_strategy = strategy is not None or amp_configs is not None
        self._optimizers.append(opt)
        for model in self._models:
            if model.built and self._overlaps(model, opt):
                self._check_same(model.engine, opt)
                opt.bind(model.engine)
        return opt

    def _programs(self) -> tuple[Program, Program, Program] | None:
        for opt in reversed(self._optimizers):
            if opt.programs is not None:
                return opt.programs
        return None

    def _program(self, index: int, name: str) -> Program:
        programs = self._programs()
        if programs is None:
            raise RuntimeError(f"fleet.{name}_program exists after distributed_optimizer(...).minimize(loss_fn, model)")
        return programs[index]

    @property
    def main_program(self) -> Program:
        """The training step with its communication."""
        return self._program(1, "main")

    @property
    def _origin_program(self) -> Program:
        """The same step with no communication: a purely local step."""
        return self._program(0, "origin")

    origin_program = _origin_program

    @property
    def startup_program(self) -> Program:
        """Makes every rank start from rank 0's parameters and buffers."""
        return self._program(2, "startup")

    def _engines(self) -> list[Engine]:
        engines = [m.engine for m in self._models if m.built]
        for opt in self._optimizers:
            engines += [e for e in opt.engines if e not in engines]
        return engines

    def applied_strategy(self) -> list[AppliedEntry]:
        """What the strategy applied, in order, and why anything was not (the latest model's)."""
        engines = self._engines()
        if self._pipelines:
            model = self._pipelines[-1]
            return [*model.applied, *(AppliedEntry(s.name, False, s.reason) for s in model.strategy.inactive_settings())]
        if not engines:
            return []
        engine = engines[-1]
        notes = [AppliedEntry(s.name, False, s.reason) for s in engine.ctx.strategy.inactive_settings()]
        return [*engine.applied, *notes]

    def get_loss_scaling(self) -> float:
        """The current AMP loss scale (1.0 when no loss scaling is on)."""
        for engine in reversed(self._engines()):
            amp = engine.unit("amp")
            if isinstance(amp, AmpUnit):
                return float(amp.scaler.scale)
        return 1.0

    # ------------------------------------------------------------------ eager style

    def distributed_model(
        self, model: torch.nn.Module, strategy: DistributedStrategy | None = None, loss_fn: Any = None,
        example_input: Any = None,
    ) -> Any:
        """Broadcast rank 0's parameters and buffers; return the model wrapped for training.

        The strategy is ``strategy``, else that of the `distributed_optimizer` holding the
        model's parameters, else the one given to ``fleet.init``; it is applied at the first
        forward (see `DistributedModel`). Two models (a GAN's) each get their own engine.
        Under ``strategy.pipeline`` the model is split into stages and this rank's stage is
        returned as a `fleetlike.pipeline.PipelineModel` (``loss_fn(output, labels)``: one
        micro-batch's mean loss; train with ``model.train_batch((x, y), opt)``; ``example_input``:
        one micro-batch of inputs, timed block by block under ``pipeline_configs.balance="time"``)."""
        ctx = self._context("fleet.distributed_model")
        if isinstance(model, DistributedModel):
            raise TypeError("fleet.distributed_model got a model it already wrapped; wrap the plain module once")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"fleet.distributed_model wraps a torch.nn.Module, got {type(model).__name__}")
        explicit = None if strategy is None else self._strategy(strategy, "fleet.distributed_model")
        if explicit is not None:
            chosen = explicit
        else:  # init's strategy, judged at the first forward unless it pipelines (judged now)
            chosen = with_epl_env(ctx.strategy)
            override = env_settings().strategy_override
            if override:
                chosen.update_from_override(override)
        if chosen.pipeline:
            chosen = explicit or self._strategy(None, "fleet.distributed_model")
            from fleetlike.fleet.pipelined import build_pipeline

            pipelined, self._hcg = build_pipeline(ctx, model, chosen, loss_fn, self._hcg, example_input)
            self._pipelines.append(pipelined)
            return pipelined
        if example_input is not None:
            raise ValueError("fleet.distributed_model(example_input=...) times a pipelined model's blocks "
                             "(strategy.pipeline with pipeline_configs.balance='time'). Fix: drop example_input")
        if loss_fn is not None:
            raise ValueError("fleet.distributed_model(loss_fn=...) is for a pipelined model (strategy.pipeline); "
                             "a data-parallel model computes its loss in the script: loss_fn(model(x), y)")
        # a model built as shards (sharded_init, the meta device) is checked, not broadcast, at stage 2/3
        broadcast_coalesced(ctx.world, [p.data for p in model.parameters() if not p.is_meta]
                            + [b for b in model.buffers() if not b.is_meta])
        me = weakref.ref(self)

        def engine_for(wrapped: DistributedModel) -> Engine:
            fleet_ = me()
            if fleet_ is None:
                raise RuntimeError("the fleet that wrapped this model is gone")
            return fleet_._build_engine(wrapped, explicit)

        wrapped = DistributedModel(model, engine_for, ctx.role.rank)
        self._models.append(wrapped)
        return wrapped

    def sharded_init(self) -> contextlib.AbstractContextManager[Any]:
        """A block inside which every ``torch.nn.Module`` built keeps only this rank's shard of its
        parameters (DeepSpeed's ``zero.Init``, Paddle's ``LazyGuard``), for sharding stages 2 and 3:
        the model is never whole on one rank, and its values are those of building it whole under
        the same seed (`fleetlike.strategies.sharded_init`). A model built under
        ``torch.device("meta")`` is materialised the same way at its first step.

        Example:
            >>> with fleet.sharded_init():
            ...     net = TransformerLM()
            >>> model = fleet.distributed_model(net)   # strategy.sharding, sharding_configs.stage 3
        """
        ctx = self._context("fleet.sharded_init")
        return sharded_init(ctx.world.rank, ctx.world.size)

    def _overlaps(self, model: DistributedModel, opt: DistributedOptimizer) -> bool:
        return bool({id(p) for p in model.module.parameters()} & opt.param_ids())

    def _check_same(self, engine: Engine, opt: DistributedOptimizer) -> None:
        if not opt.explicit_strategy:
            return  # the optimizer took init's default; the model's own strategy rules
        mine, theirs = engine.ctx.strategy.to_dict(), opt.user_defined_strategy.to_dict()
        diff = [f"{k}: model {mine.get(k)!r}, optimizer {theirs.get(k)!r}"
                for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
        if diff:
            raise ValueError(
                "fleet.distributed_model and fleet.distributed_optimizer were given different strategies "
                "for one model:\n  " + "\n  ".join(diff)
                + "\ngive the strategy once (to fleet.init, or to distributed_optimizer), or the same to both"
            )

    def _build_engine(self, model: DistributedModel, explicit: DistributedStrategy | None) -> Engine:
        ctx = self._context("the wrapped model's forward")
        owners = [o for o in self._optimizers if self._overlaps(model, o)]
        chosen = [o.user_defined_strategy for o in owners if o.explicit_strategy]
        strategy = explicit or (chosen[0] if chosen else self._strategy(None, "the wrapped model's forward"))
        engine = build_engine(ctx.step_context(model.module, strategy))
        for opt in owners:
            self._check_same(engine, opt)
            opt.bind(engine)
        return engine

    def get_hybrid_communicate_group(self) -> Any:
        """Paddle's ``fleet.get_hybrid_communicate_group()``: this rank's place among the
        ``dp_degree x pp_degree`` ranks of init's strategy (`fleetlike.pipeline.HybridCommunicateGroup`:
        ``get_data_parallel_rank()``, ``get_stage_id()``, ...). Collective on the first call
        (every rank calls it, or ``fleet.distributed_model`` of a pipelined model, first)."""
        if self._hcg is None:
            from fleetlike.fleet.pipelined import hybrid_group

            ctx = self._context("fleet.get_hybrid_communicate_group()")
            self._hcg = hybrid_group(ctx, self._strategy(None, "fleet.get_hybrid_communicate_group()"))
        return self._hcg

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """AMP's autocast (dtype and op lists of the strategy) for code outside the wrapped
        model's forward, such as a loss computed from its outputs; a no-op without AMP."""
        engines = self._engines()
        amp = next((e.unit("amp") for e in reversed(engines) if e.unit("amp") is not None), None)
        if amp is None:
            strategy = self._context("fleet.autocast()").strategy
            if not strategy.amp:
                yield
                return
            with amp_autocast(strategy.amp_configs, self.device().type):
                yield
            return
        with amp.forward_context():
            yield

    def register_state(self, name: str, obj: Any) -> None:
        """Save and restore ``obj`` (anything with ``state_dict`` / ``load_state_dict``, such as
        an LR scheduler) with `save_persistables` / `load_persistables`."""
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"fleet.register_state({name!r}, ...): {type(obj).__name__} has no state_dict/load_state_dict")
        self._registered[name] = obj

    def full_state_dict(self, model: torch.nn.Module, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The model's full parameters and buffers as plain tensors under its own names (for
        evaluation, export, comparison), whatever the strategy: sharded ones (stages 2 and 3)
        are gathered, so every rank calls it. ``rank0_only``: ranks other than 0 get ``{}``.
        A fleetlike model wrapper answers through its ``_full_state_dict(rank0_only)``."""
        own = getattr(model, "_full_state_dict", None)
        if callable(own):
            return own(rank0_only)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"fleet.full_state_dict takes a torch.nn.Module, got {type(model).__name__}")
        return full_state_dict(model, rank0_only, self._context("fleet.full_state_dict").role.rank)

    # ------------------------------------------------------------------ save / load

    def _training_state(self, what: str) -> ckpt.TrainingState:
        ctx = self._context(f"fleet.{what}")
        if self._programs() is not None:
            opt = next(o for o in reversed(self._optimizers) if o.programs is not None)
            models: list[torch.nn.Module] = [opt.engines[0].ctx.model]
            optimizers = [opt]
            strategy = opt.user_defined_strategy
        else:
            if not self._models:
                raise RuntimeError(
                    f"fleet.{what} needs a model: minimize(loss_fn, model) (program style) or "
                    "fleet.distributed_model(model) (eager style) first"
                )
            models = [m.module for m in self._models]
            optimizers = list(self._optimizers)
            strategy = self._models[0].engine.ctx.strategy
        runs = {p.name: p.runs for p in (self._programs() or ())}
        return ckpt.TrainingState(models, list(optimizers), dict(self._registered), ctx.role.world_size,
                                  ctx.role.rank, strategy.to_dict(), runs)

    def save_persistables(self, executor: Executor | None, dirname: str, main_program: Program | None = None) -> None:
        """Save everything needed to resume exactly; atomic. Not collective (rank 0 may call it alone),
        except for a pipelined model: every rank calls it, each stage's first pipeline writes its
        stage's file (`fleetlike.pipeline.checkpoint`)."""
        if self._pipelines:
            from fleetlike.fleet.pipelined import save_pipeline

            runs = {p.name: p.runs for p in (self._programs() or ())}
            save_pipeline(self._context("fleet.save_persistables"), dirname, self._pipelines[-1],
                          self._optimizers, self._registered, runs)
            return
        ckpt.save_training(dirname, self._training_state("save_persistables"))

    def load_persistables(self, executor: Executor | None, dirname: str, main_program: Program | None = None) -> None:
        """Restore what `save_persistables` wrote; checks the job fits and says what differs."""
        if self._pipelines:
            from fleetlike.fleet.pipelined import load_pipeline

            saved = load_pipeline(dirname, self._pipelines[-1], self._optimizers, self._registered)
            for program in self._programs() or ():
                program.runs = saved.get(program.name, program.runs)
            return
        state = self._training_state("load_persistables")
        runs = ckpt.load_training(dirname, state, self.device())
        for program in self._programs() or ():
            if program.name in runs:
                program.runs = runs[program.name]

    def save_inference_model(
        self,
        executor: Executor | None,
        dirname: str,
        feeded_var_names: list[str] | None = None,
        target_vars: list[str] | None = None,
        main_program: Program | None = None,
        export_for_deployment: bool = True,
    ) -> None:
        """Save the model for inference only (no optimizer, no communication); atomic.

        ``export_for_deployment=True`` (Paddle's default) also writes ``served.pt``: the model
        as TorchScript in eval mode, which a plain PyTorch process loads with
        ``torch.jit.load`` without fleetlike or the model's code (a model server)."""
        state = self._training_state("save_inference_model")
        ckpt.save_inference_model(dirname, state.models[0], list(feeded_var_names or []),
                                  [getattr(t, "name", t) for t in (target_vars or [])],
                                  served=export_for_deployment)


fleet = Fleet()

"""`DistributedOptimizer`: the user's optimizer plus the strategy, and a real `torch.optim.Optimizer`.

It is an ``Optimizer`` (as Horovod's is), sharing the wrapped optimizer's ``param_groups``,
``state`` and ``defaults`` objects, so learning-rate schedulers, ``torch.amp.GradScaler``,
``torch.optim.swa_utils`` and ``isinstance`` checks work on it and act on the wrapped optimizer.
The update itself is the wrapped optimizer's ``step``; around it the strategy engine runs.

Program style: ``minimize(loss_fn, model)`` builds the engine and the three programs.
Eager style: ``step()`` synchronizes (waits for the gradient buckets, unscales and checks under
AMP), updates unless a unit skips the step (a non-finite AMP step, a gradient-merge micro-step),
then runs the after-update hooks (local SGD's averaging, the loss-scale update); ``zero_grad()``
clears unless a gradient-merge window is still accumulating. ``backward(loss)`` is
``loss.backward()`` with the loss scaled explicitly; ``synchronize()`` and
``skip_synchronize()`` allow gradient clipping between communication and update (as Horovod).

``state_dict()`` is the wrapped optimizer's plus a ``"fleetlike"`` entry with what the strategy
keeps (loss scale, local SGD counters and snapshots, the gradient-merge window), so a checkpoint
of the optimizer alone resumes the strategy exactly. Under ``strategy.sharding`` it holds this
rank's partition only (a shard); ``load_state_dict`` accepts a full state and keeps the
partition (`fleetlike.fleet.checkpoint.consolidate_optimizer_state` merges shards).

Example:
    >>> opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
    >>> loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad(); sched.step()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from fleetlike.collectives.divergence import DivergenceGuard
from fleetlike.roles.settings import every_from_env
from fleetlike.config import DistributedStrategy
from fleetlike.fleet.context import FleetContext
from fleetlike.program import Program
from fleetlike.strategies.engine import Engine, build_engine
from fleetlike.strategies.programs import LossFn, build_programs

__all__ = ["DistributedOptimizer"]

_STATE_KEY = "fleetlike"


class DistributedOptimizer(torch.optim.Optimizer):
    """The user's optimizer plus the strategy; see the module docstring."""

    def __init__(self, optimizer: torch.optim.Optimizer, strategy: DistributedStrategy, context: FleetContext) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"distributed_optimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("distributed_optimizer got an optimizer that is already a DistributedOptimizer; wrap the plain one once")
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self.__dict__["_scratch"] = {"param_groups": []}
        super().__init__(params, dict(optimizer.defaults))
        del self.__dict__["_scratch"]
        # from here on param_groups / state / defaults are the wrapped optimizer's (properties)
        self.inner_optimizer = optimizer
        self.user_defined_strategy = strategy
        #: the strategy was given to this call (not init's default): it must match the model's
        self.explicit_strategy = True
        self._context = context
        self.engines: list[Engine] = []
        self.programs: tuple[Program, Program, Program] | None = None
        self._skip_sync = False
        self._pending_state: dict[str, Any] | None = None
        #: set by a pipelined model's train_batch: step() is then the wrapped optimizer's
        self.pipelined = False
        #: divergence guard per engine (by id; dropped with the engines on `rebind`)
        self._guards: dict[int, DivergenceGuard | None] = {}

    # One set of groups, state and defaults: the wrapped optimizer's, read through each time
    # (its load_state_dict replaces the objects), so schedulers and scalers act on what steps.
    # Optimizer.__init__ assigns them before the wrapped optimizer is known; those go nowhere.

    def _shared(self, name: str) -> Any:
        inner = self.__dict__.get("inner_optimizer")
        return getattr(inner, name) if inner is not None else self.__dict__["_scratch"][name]

    def _share(self, name: str, value: Any) -> None:
        inner = self.__dict__.get("inner_optimizer")
        if inner is not None:
            setattr(inner, name, value)
        else:
            self.__dict__.setdefault("_scratch", {})[name] = value

    param_groups = property(lambda self: self._shared("param_groups"),  # type: ignore[assignment]
                            lambda self, v: self._share("param_groups", v))
    state = property(lambda self: self._shared("state"),  # type: ignore[assignment]
                     lambda self, v: self._share("state", v))
    defaults = property(lambda self: self._shared("defaults"),  # type: ignore[assignment]
                        lambda self, v: self._share("defaults", v))

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.inner_optimizer!r})"

    def __getattr__(self, name: str) -> Any:
        # only called for names the wrapper lacks: the wrapped optimizer's own extras
        inner = self.__dict__.get("inner_optimizer")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    def param_ids(self) -> set[int]:
        return {id(p) for g in self.param_groups for p in g["params"]}

    # ------------------------------------------------------------------ engines

    def bind(self, engine: Engine) -> None:
        """Drive ``engine``'s model (called by the fleet when the two meet)."""
        if engine in self.engines:
            return
        runner = next((e.update_runner for e in [*self.engines, engine] if e.update_runner), None)
        if self.engines and runner is not None:
            # the runner steps and gathers one model's partition; with a second model the first
            # would gather before the shared update ran (its owned parameters never broadcast)
            raise ValueError(
                f"strategy.{runner} runs the optimizer update of one wrapped model, but this "
                f"distributed_optimizer already drives {len(self.engines)} other wrapped model(s): "
                "wrap the modules in one (e.g. torch.nn.ModuleDict({'encoder': enc, 'head': head})) and "
                "call fleet.distributed_model once, or give each model its own distributed_optimizer"
            )
        if engine.ctx.optimizer is not None and engine.ctx.optimizer is not self.inner_optimizer:
            if engine.needs_optimizer:
                raise RuntimeError(
                    f"two fleetlike optimizers drive one model, but strategy.{engine.needs_optimizer[0]} "
                    "acts at the optimizer step and needs exactly one: give the model's parameters to "
                    "one distributed_optimizer (param groups can differ)"
                )
        else:
            engine.ctx.optimizer = self.inner_optimizer
            for unit in engine.units:
                unit.bind(self.inner_optimizer)
        self.engines.append(engine)
        if self._pending_state is not None and len(self.engines) == len(self._pending_state):
            self._load_engines(self._pending_state)

    # ------------------------------------------------------------------ program style

    def minimize(self, loss_fn: LossFn, model: torch.nn.Module) -> tuple[Program, Program]:
        """Build ``fleet.main_program``, ``fleet._origin_program`` and ``fleet.startup_program``.

        ``loss_fn(model, feed)`` returns the scalar loss or a mapping with a ``"loss"`` entry
        (other entries can be fetched by name). Returns ``(main_program, startup_program)``.
        """
        if not callable(loss_fn):
            raise TypeError(f"minimize: loss_fn must be callable (model, feed) -> loss, got {loss_fn!r}")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"minimize: model must be a torch.nn.Module, got {type(model).__name__}")
        if self.engines or self.programs is not None:
            raise RuntimeError(
                "minimize: this optimizer already drives a model (an earlier minimize or "
                "fleet.distributed_model); create a new fleet.distributed_optimizer for another program"
            )
        from fleetlike.pipeline import PipelineModel

        if isinstance(model, PipelineModel):  # a pipelined model lays out its own step
            from fleetlike.pipeline.programs import pipeline_programs

            self.programs = pipeline_programs(model, loss_fn, self)
            return self.programs[1], self.programs[2]
        engine = self._program_engine(model)
        self.programs = build_programs(engine, loss_fn)
        self._minimized = (loss_fn, model)
        origin, main, startup = self.programs
        return main, startup

    def _program_engine(self, model: torch.nn.Module) -> Engine:
        """The program style's engine for ``model``, driven by this optimizer."""
        ctx = self._context.step_context(model, self.user_defined_strategy)
        ctx.optimizer = self.inner_optimizer
        engine = build_engine(ctx)
        for unit in engine.units:
            unit.bind(self.inner_optimizer)
        self.engines.append(engine)
        return engine

    def rebind(self, context: FleetContext) -> None:
        """Drive the same model(s) on ``context``'s communicators (the fleet's world was
        replaced). Eager style: the engines are dropped and bound again when the models build
        theirs; their strategy state carries over (loaded into the new engines). Program style:
        the engine and the three programs are rebuilt, the `Program` objects updated in place."""
        carried = [engine.state_dict() for engine in self.engines]
        self._context = context
        self.engines = []
        self._guards = {}
        if self.programs is None:
            self._pending_state = carried or self._pending_state
            return
        loss_fn, model = self._minimized
        engine = self._program_engine(model)
        self._load_engines(carried)
        for old, new in zip(self.programs, build_programs(engine, loss_fn)):
            old.ops, old.notes, old.device = new.ops, new.notes, new.device

    # ------------------------------------------------------------------ eager style

    def _driven(self) -> list[Engine]:
        if not self.engines:
            raise RuntimeError(
                "eager style needs the model wrapped before training: model = fleet.distributed_model(model), "
                "then run its forward (the optimizer finds the model by its parameters)"
            )
        return self.engines

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` with the strategy's loss scaling (AMP) applied explicitly; also
        records the loss for units that need it (adaptive local SGD)."""
        engines = self._driven()
        engines[0].backward(loss)
        for engine in engines[1:]:
            engine.begin().loss = loss

    def synchronize(self) -> bool:
        """Wait until every gradient is averaged over the ranks (before clipping, say).

        With AMP the gradients are also unscaled and checked; returns True when the step is
        finite on every rank (``step()`` then updates; otherwise it skips, on every rank)."""
        states = [engine.synchronize() for engine in self._driven()]
        return not any(st.skip_update for st in states)

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside, ``step()`` does not synchronize again (call ``synchronize()`` first)."""
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    def step(self, closure: Any = None, *, loss: torch.Tensor | float | None = None) -> Any:  # type: ignore[override]
        """One update through the strategy (see the module docstring).

        ``loss``: this step's loss, for adaptive local SGD (or call ``backward(loss)``); a
        ``closure`` is evaluated first (with grad enabled) and its result is the loss. Under
        ``strategy.pipeline`` the pipelined model's ``train_batch`` calls it after averaging
        the stage's gradients: the wrapped optimizer's step."""
        if self.pipelined and not self.engines:
            return self.inner_optimizer.step(closure)
        engines = self._driven()
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        result: list[Any] = []

        def update() -> Any:
            result.append(self.inner_optimizer.step())
            return result[-1]

        # several engines (one optimizer over two wrapped models): the update runs once, and
        # only when no model's units skip it (a non-finite AMP step, a merge micro-step)
        states = [engine.synchronize() for engine in engines]
        skip = any(st.skip_update or st.accumulate for st in states)
        guards = [self._guard(engine) for engine in engines]
        for i, engine in enumerate(engines):
            last = i == len(engines) - 1
            engine.update(update if last and not skip else (lambda: None), loss=loss)
        if not skip:
            for guard in guards:
                if guard is not None:
                    guard.tick()
        return loss if closure is not None else (result[0] if result else None)

    def _guard(self, engine: Engine) -> DivergenceGuard | None:
        """The divergence guard of ``engine``'s model, made (and first checked: the parameters
        are still the ones broadcast from rank 0) at its first step; None under local SGD,
        whose ranks hold different parameters between two averagings by design."""
        guards = self._guards
        if id(engine) not in guards:
            s, groups = engine.ctx.strategy, engine.ctx.groups
            guard = None
            if not (s.localsgd or s.adaptive_localsgd):
                comm = groups.extra("fleet divergence guard", 0, groups.world.rank)
                assert comm is not None
                # shards (stages 2 and 3) differ between the ranks by design: the replicated ones are checked
                replicated = [(n, p) for n, p in engine.ctx.model.named_parameters() if not hasattr(p, "to_local")]
                guard = DivergenceGuard(comm, replicated, every=every_from_env(),
                                        what="fleet.distributed_optimizer")
                guard.check("at the first step, after fleet.distributed_model's broadcast from rank 0")
            guards[id(engine)] = guard
        return guards[id(engine)]

    @property
    def step_info(self) -> dict[str, Any]:
        """What the strategy recorded in the last ``step()`` (the facts ``fetch_list`` offers in
        the program style: ``found_inf``, ``loss_scale``, ``localsgd_k``, ``bytes_communicated``,
        ``collectives``, ``merge_micro_step``, ``slow_ranks``, ...)."""
        info: dict[str, Any] = {}
        for engine in self.engines:
            if engine.last is not None:
                info.update(engine.last.info)
        return info

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (in place where they are bucket views), except inside an
        unfinished gradient-merge window."""
        for engine in self.engines:
            engine.clear()
        covered = self._covered()
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) not in covered and p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.detach_().zero_()

    def _covered(self) -> set[int]:
        """Ids of the parameters whose gradients an engine clears (cached per set of engines)."""
        key = tuple(id(e) for e in self.engines)
        if self.__dict__.get("_covered_key") != key:
            self._covered_ids = {id(p) for e in self.engines for p in e.ctx.model.parameters()}
            self._covered_key = key
        return self._covered_ids

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        state = self.inner_optimizer.state_dict()
        state[_STATE_KEY] = [engine.state_dict() for engine in self.engines]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        engines = state.pop(_STATE_KEY, None)
        self.inner_optimizer.load_state_dict(state)
        for engine in self.engines:  # a full (consolidated) state: keep this rank's partition
            sharding = engine.unit("sharding")
            if sharding is not None:
                sharding.drop_foreign_state(self.inner_optimizer)  # type: ignore[attr-defined]
        if engines is None:
            return
        if len(engines) == len(self.engines):
            self._load_engines(engines)
        elif not self.engines:
            self._pending_state = engines  # eager style: applied when the model's engine is built
        else:
            raise ValueError(
                f"optimizer state holds the strategy state of {len(engines)} model(s), this optimizer "
                f"drives {len(self.engines)}; load it into the job it was saved from"
            )

    def _load_engines(self, engines: list[dict[str, Any]]) -> None:
        for engine, saved in zip(self.engines, engines):
            engine.load_state_dict(saved)
        self._pending_state = None

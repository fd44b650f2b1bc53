"""The `Fleet` facade of API.md section 4: thin, delegating to roles, comm and strategies.

It holds what a process needs between calls (its role, communicators, the programs built by
``minimize``) and no training logic of its own.

Example (the four steps):
    >>> from fleetlike import fleet, DistributedStrategy, roles     # 1. import
    >>> fleet.init(roles.PaddleCloudRoleMaker(is_collective=True))  # 2. roles + strategy
    >>> opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    >>> opt.minimize(loss_fn, model)
    >>> exe = fleetlike.Executor(fleet.device())                     # 3. train
    >>> exe.run(fleet.startup_program)
    >>> exe.run(fleet.main_program, feed=batch, fetch_list=["loss"])
    >>> if fleet.is_first_worker(): fleet.save_persistables(exe, "ckpt")   # 4. save
"""

from __future__ import annotations

import dataclasses
import os

import torch

from fleetlike.collectives import GradReducer, broadcast_coalesced, make_reducer
from fleetlike.comm import DEFAULT_TIMEOUT, CommGroups, Communicator, create_world
from fleetlike.fleet import checkpoint as ckpt
from fleetlike.fleet.optimizer import DistributedOptimizer
from fleetlike.fleet.util import Util
from fleetlike.mixed_precision import DecoratedOptimizer
from fleetlike.program import Executor, Program
from fleetlike.roles import Role, RoleMaker, as_role
from fleetlike.roles.settings import env_settings
from fleetlike.strategies import DistributedStrategy
from fleetlike.strategies.compose import AppliedEntry, Build
from fleetlike.strategies.data_parallel import gradient_collective

__all__ = ["Fleet", "fleet"]

_FORMAT = 1


@dataclasses.dataclass
class _Context:
    role: Role
    world: Communicator
    groups: CommGroups
    device: torch.device
    strategy: DistributedStrategy
    timeout: float


def _device_for(role: Role) -> torch.device:
    if torch.cuda.is_available() and (role.selected_gpus or os.environ.get("CUDA_VISIBLE_DEVICES")):
        gpus = role.selected_gpus
        return torch.device("cuda", gpus[0] if gpus else role.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


class Fleet:
    """Process-wide entry point; use the module-level ``fleet`` instance."""

    def __init__(self) -> None:
        self._ctx: _Context | None = None
        self._build: Build | None = None
        self._programs: dict[str, Program] = {}
        self._eager: GradReducer | None = None
        self._eager_optimizer: DistributedOptimizer | None = None
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
        """Set up this process's communicators. ``role_maker=None`` auto-detects the launch."""
        if is_collective is not True:
            raise ValueError(
                "fleet.init(is_collective=False) asks for parameter-server mode, which fleetlike "
                "does not provide; use is_collective=True (collective training)"
            )
        env = env_settings()
        if strategy is not None and not isinstance(strategy, DistributedStrategy):
            raise TypeError(f"fleet.init: strategy must be a DistributedStrategy, got {type(strategy).__name__}")
        role = as_role(role_maker)
        device = _device_for(role)
        limit = DEFAULT_TIMEOUT if timeout is None else timeout
        self.shutdown()
        world = create_world(role, backend=backend or env.backend or "auto", timeout=limit, device=device)
        world.timeout = limit
        world.check_collectives = bool(check_collectives or env.check_collectives)
        self._ctx = _Context(role, world, CommGroups(world, role), device, strategy or DistributedStrategy(), limit)

    def shutdown(self) -> None:
        """Close the communicators (also done at exit). ``init`` may be called again after."""
        if self._ctx is not None:
            self._ctx.groups.close()
        self._ctx, self._build, self._programs, self._eager = None, None, {}, None
        self._eager_optimizer = None

    def _context(self, what: str) -> _Context:
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

    # ------------------------------------------------------------------ optimizer and programs

    def distributed_optimizer(
        self, optimizer: torch.optim.Optimizer, strategy: DistributedStrategy | None = None
    ) -> DistributedOptimizer:
        ctx = self._context("fleet.distributed_optimizer")
        chosen = (strategy or ctx.strategy).copy()
        if isinstance(optimizer, DecoratedOptimizer):  # seed 003's mixed_precision.decorate
            chosen.amp = True
            chosen.amp_configs = optimizer.amp_configs
            optimizer = optimizer.optimizer
        override = env_settings().strategy_override
        if override:
            chosen.update_from_override(override)
        chosen.validate_combination()
        self._eager_optimizer = DistributedOptimizer(optimizer, chosen, self)
        return self._eager_optimizer

    def _set_programs(self, build: Build, origin: Program, main: Program, startup: Program) -> None:
        self._build = build
        self._programs = {"origin": origin, "main": main, "startup": startup}

    def _program(self, name: str) -> Program:
        if name not in self._programs:
            raise RuntimeError(f"fleet.{name}_program exists after distributed_optimizer(...).minimize(loss_fn, model)")
        return self._programs[name]

    @property
    def main_program(self) -> Program:
        """The training step with its communication."""
        return self._program("main")

    @property
    def _origin_program(self) -> Program:
        """The same step with no communication: a purely local step."""
        return self._program("origin")

    origin_program = _origin_program

    @property
    def startup_program(self) -> Program:
        """Makes every rank start from rank 0's parameters and buffers."""
        return self._program("startup")

    def applied_strategy(self) -> list[AppliedEntry]:
        """What ``minimize`` applied, in order, and why anything was not."""
        if self._build is None:
            return []
        notes = [AppliedEntry(s.name, False, s.reason) for s in self._build.strategy.inactive_settings()]
        return [*self._build.applied, *notes]

    def get_loss_scaling(self) -> float:
        """The current AMP loss scale (1.0 when no loss scaling is on)."""
        amp = self._build.states.get("amp") if self._build else None
        if amp is None and self._eager_optimizer is not None:
            amp = self._eager_optimizer.scaler
        return float(amp.scale) if amp is not None else 1.0

    # ------------------------------------------------------------------ eager style

    def distributed_model(
        self, model: torch.nn.Module, strategy: DistributedStrategy | None = None
    ) -> torch.nn.Module:
        """Broadcast rank 0's parameters and buffers, attach the gradient hooks; returns ``model``.

        The bucketing follows ``strategy`` (default: the one given to ``fleet.init``)."""
        ctx = self._context("fleet.distributed_model")
        s = strategy or ctx.strategy
        broadcast_coalesced(ctx.world, [p.data for p in model.parameters()] + list(model.buffers()))
        if self._eager is not None:
            self._eager.remove()
        collective, _ = gradient_collective(s, ctx.groups, ctx.role)  # as the data-parallel pass
        self._eager = make_reducer(model, collective, cap_bytes=s.bucket_cap_bytes(),
                                   find_unused=s.find_unused_parameters, check_nan_inf=s.check_nan_inf,
                                   auto_arm=True)
        return model

    def _eager_reducer(self, required: bool = True) -> GradReducer | None:
        if self._eager is None and required:
            raise RuntimeError("eager style needs model = fleet.distributed_model(model) first")
        return self._eager

    # ------------------------------------------------------------------ save / load

    def save_persistables(self, executor: Executor | None, dirname: str, main_program: Program | None = None) -> None:
        """Save everything needed to resume exactly; atomic. Not collective (rank 0 may call it alone)."""
        build = self._need_build("save_persistables")
        with ckpt.atomic_dir(dirname) as tmp:
            torch.save(build.model.state_dict(), tmp / "model.pt")
            torch.save(build.optimizer.state_dict(), tmp / "optimizer.pt")
            torch.save({k: v.state_dict() for k, v in build.states.items()}, tmp / "strategy_state.pt")
            ckpt.write_json(tmp / "fleet.json", {
                "format": _FORMAT,
                "world_size": build.role.world_size,
                "saved_by_rank": build.role.rank,
                "strategy": build.strategy.to_dict(),
                "program_runs": {k: p.runs for k, p in self._programs.items()},
            })

    def load_persistables(self, executor: Executor | None, dirname: str, main_program: Program | None = None) -> None:
        """Restore what `save_persistables` wrote; checks the job fits and says what differs."""
        build = self._need_build("load_persistables")
        path = ckpt.resolve(dirname)
        meta = ckpt.read_json(path / "fleet.json")
        problems = []
        if meta["world_size"] != build.role.world_size:
            problems.append(f"world size: saved {meta['world_size']}, now {build.role.world_size}")
        now = build.strategy.to_dict()
        for key in sorted(set(now) | set(meta["strategy"])):
            if now.get(key) != meta["strategy"].get(key):
                problems.append(f"strategy.{key}: saved {meta['strategy'].get(key)!r}, now {now.get(key)!r}")
        if problems:
            raise ckpt.CheckpointError(
                f"checkpoint {path} does not fit this job:\n  " + "\n  ".join(problems)
                + "\nrestart with the saved world size and strategy (DistributedStrategy.from_dict)"
            )
        build.model.load_state_dict(torch.load(path / "model.pt", map_location=build.device, weights_only=True))
        build.optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=build.device, weights_only=True))
        states = torch.load(path / "strategy_state.pt", map_location=build.device, weights_only=False)
        for name, state in states.items():
            build.states[name].load_state_dict(state)
        for name, runs in meta.get("program_runs", {}).items():
            if name in self._programs:
                self._programs[name].runs = runs

    def save_inference_model(
        self,
        executor: Executor | None,
        dirname: str,
        feeded_var_names: list[str] | None = None,
        target_vars: list[str] | None = None,
        main_program: Program | None = None,
        export_for_deployment: bool = True,
    ) -> None:
        """Save the model for inference only (no optimizer, no communication); atomic."""
        build = self._need_build("save_inference_model")
        with ckpt.atomic_dir(dirname) as tmp:
            torch.save(build.model, tmp / "model.pt")
            torch.save(build.model.state_dict(), tmp / "state_dict.pt")
            ckpt.write_json(tmp / "inference.json", {
                "feeded_var_names": list(feeded_var_names or []),
                "target_vars": [getattr(t, "name", t) for t in (target_vars or [])],
                "model_class": f"{type(build.model).__module__}.{type(build.model).__qualname__}",
            })

    def _need_build(self, what: str) -> Build:
        if self._build is None:
            raise RuntimeError(f"fleet.{what} needs distributed_optimizer(...).minimize(loss_fn, model) first")
        return self._build


def load_inference_model(dirname: str) -> tuple[torch.nn.Module, list[str], list[str]]:
    """Load what `Fleet.save_inference_model` wrote: ``(model in eval mode, feeds, targets)``."""
    path = ckpt.resolve(dirname)
    meta = ckpt.read_json(path / "inference.json")
    model = torch.load(path / "model.pt", weights_only=False)
    model.eval()
    return model, meta["feeded_var_names"], meta["target_vars"]


fleet = Fleet()

"""`FleetHookState`: what fleetlike's DDP communication hook needs, built from a `DistributedStrategy`.

The state plays the part of torch's ``PowerSGDState``: it holds the settings, the communicators
and whatever lives across steps (the backward-pass counter of local accumulation, gossip's
residuals, the slow-rank window), and it pickles without its communicators (``__getstate__``
drops them; after ``__setstate__`` the next hook call meets the job again from the
environment, or call `FleetHookState.connect` with communicators of your own).

Every setting is a strategy field with the meaning it has everywhere in fleetlike:

==============================================  ===================================================
``use_hierarchical_allreduce`` (+ configs)      two-level allreduce by node, segmented pipeline
``fp16_allreduce`` / ``fp16_allreduce_configs``  16-bit wire: dtype, mode "all" / "mixed", grad_scale
``nccl_comm_num``                               communicators: DDP bucket i travels on ring i % n
``gradient_merge_configs.k_steps``              local accumulation: communicate every k-th backward
``check_nan_inf``                               NaN/Inf in an averaged gradient stops the job,
                                                naming the parameter and the rank it came from
``slow_rank_check`` (+ configs)                 slow-rank report every ``every_n_steps`` passes
                                                (the core's `SlowRankWindow`, as in every face)
``gossip`` / ``gossip_configs``                 down-sampling with error feedback (1/n per step)
``fuse_grad_size_in_MB``                        DDP's ``bucket_cap_mb`` (`fleetlike.auto` passes it;
                                                a hook cannot change buckets DDP already built)
==============================================  ===================================================

Example:
    >>> state = FleetHookState(DistributedStrategy(use_hierarchical_allreduce=True, fp16_allreduce=True))
    >>> ddp_model.register_comm_hook(state, fleetlike_hook)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from fleetlike.collectives import Accumulation, Downsampler, RingWorkers
from fleetlike.collectives.buckets import non_finite
from fleetlike.comm import CommGroups, Communicator, Work, create_world
from fleetlike.comm.cuda import stream_device
from fleetlike.config import DistributedStrategy, rules
from fleetlike.ddp.world import check_world, groups_for, model_group
from fleetlike.roles import Role, detect_role
from fleetlike.roles.settings import env_settings
from fleetlike.strategies.data_parallel import gradient_collective
from fleetlike.strategies.health import SlowRankWindow
from fleetlike.ddp.tuning import HookTuning
from fleetlike.tune import requested

__all__ = ["FleetHookState"]


class FleetHookState:
    """Settings, communicators and cross-step state of `fleetlike_hook` (see the module doc).

    Args:
        strategy: the `DistributedStrategy` whose fields choose the collective (checked for
            combinations it cannot run; a copy is kept).
        groups, role: fleetlike communicators of the job and this process's `Role`; None meets
            the bound DDP model's own process group on the first hook call (through the
            script's torch.distributed store: `fleetlike.ddp.world`), or, given only ``role``,
            that role's job.
        model: the DDP model (or its module), whose parameter names the NaN check reports and
            gossip's residuals are keyed by (needed to checkpoint them); `register` binds it.
    """

    def __init__(
        self,
        strategy: DistributedStrategy | None = None,
        *,
        groups: CommGroups | None = None,
        role: Role | None = None,
        model: torch.nn.Module | None = None,
    ) -> None:
        s = (strategy or DistributedStrategy()).copy()
        if not isinstance(s, DistributedStrategy):
            raise TypeError(f"strategy must be a DistributedStrategy, got {type(strategy).__name__}")
        s = requested(s) or s  # FLEETLIKE_AUTOTUNE=1
        s.validate_combination()
        rules.refuse_unhonoured(s, "ddp")
        self.strategy = s
        #: local accumulation: the core's counter of backward passes, a window of k_steps
        self.accumulation = Accumulation(int(s.gradient_merge_configs["k_steps"]) if s.gradient_merge else 1,
                                         field="gradient_merge_configs.k_steps")
        self.nan_check = bool(s.check_nan_inf)
        cfg = s.slow_rank_check_configs
        self.perf_every = int(cfg["every_n_steps"]) if s.slow_rank_check else 0
        self.perf_factor = float(cfg["factor"])
        self.gossip_n = int(s.gossip_configs["downsample_n_elements"]) if s.gossip else 1
        #: whether the pass in progress communicates (set by its first bucket)
        self.communicating = False
        #: the last slow-rank report: ``[(rank, host, seconds per step), ...]``, each rank's own
        #: work and data wait per step (`fleetlike.strategies.health.SlowRankReport`'s fields)
        self.slow: list[tuple[int, str, float]] = []
        self.step_times: list[float] = []
        self.data_wait: list[float] = []
        self.sampler = Downsampler(self.gossip_n) if self.gossip_n > 1 else None
        self._pool: dict[str, torch.Tensor] = {}  # gossip residuals of a re-laid-out bucket, by name
        self.names: dict[int, str] = {}
        self._param_bytes: list[int] = []
        self.process_group: Any = None  # the bound DDP model's group (`bind`)
        self._param_sizes: dict[str, int] = {}
        self._lock = threading.Lock()
        self._done_at: float | None = None
        self._launched_at = 0.0
        self._comm_state()
        self._role_hint = role  # whom to meet on the first bucket when no groups are given
        if model is not None:
            self.bind(model)
        if groups is not None:
            self.connect(groups, role)

    def _comm_state(self) -> None:
        self.groups: CommGroups | None = None
        self.role: Role | None = None
        self.collective: Any = None
        #: the online tuner (strategy.auto_tune): it picks the collective of each pass
        self.tuning: HookTuning | None = None
        self.notes: list[tuple[str, bool, str]] = []
        self.health: Communicator | None = None
        self.perf: SlowRankWindow | None = None  # the slow-rank window (`connect` makes it)
        self._finishers: RingWorkers | None = None
        self._owns_groups = False

    # ------------------------------------------------------------------ binding and meeting

    def bind(self, model: torch.nn.Module) -> None:
        """Name the parameters of ``model`` (a DDP model's ``module.`` prefix is dropped)."""
        module = getattr(model, "module", model)
        self.names = {id(p): n for n, p in module.named_parameters()}
        self._param_bytes = [p.numel() * p.element_size() for p in module.parameters() if p.requires_grad]
        self.process_group = model_group(model)
        if self.groups is not None:
            check_world(self.groups, self.process_group)

    def connect(
        self, groups: CommGroups | None = None, role: Role | None = None, device: torch.device | None = None
    ) -> None:
        """Build the collective on ``groups`` (collective: every rank calls it, in the same order
        as its other group creations); None meets the job from the environment, on a backend
        that moves tensors of ``device`` (the buckets' device: NCCL for CUDA buckets)."""
        if groups is None and role is None and self._role_hint is None and self.process_group is not None:
            groups = groups_for(self.process_group, device)
        elif groups is None:
            role = role or self._role_hint or detect_role()
            backend = env_settings().backend or "auto"  # FLEETLIKE_BACKEND, as fleet.init reads it
            groups, self._owns_groups = CommGroups(create_world(role, backend=backend, device=device), role), True
        check_world(groups, self.process_group)
        role = groups.role if role is None else role
        plain = self.strategy.copy()
        plain.gossip = False  # gossip is applied by the hook itself (keys survive DDP's re-bucketing)
        self.collective, self.notes = gradient_collective(plain, groups, role)
        self.groups, self.role = groups, role
        if self.strategy.auto_tune:
            self.tuning = HookTuning(self.strategy, groups, role, self.collective, self._param_bytes)
        if self.perf_every:
            self.health = groups.extra("ddp slow-rank check", 0, groups.world.rank)
            self.perf = SlowRankWindow(self.perf_every, self.perf_factor, role)
        # finishers only wait (no NCCL calls): threads of their own, on the hook's stream position
        self._finishers = RingWorkers(max(1, int(self.strategy.nccl_comm_num)), "fleetlike-ddp",
                                      device=stream_device(groups.world), issues=False)

    def ensure_connected(self, device: torch.device | None = None) -> None:
        """Connect on the first bucket (``device``: where DDP keeps its buckets)."""
        if self.collective is None:
            self.connect(device=device)

    def close(self) -> None:
        """Stop the helper threads; close the communicators this state created itself."""
        if self._finishers is not None:
            self._finishers.shutdown()
        if self._owns_groups and self.groups is not None:
            self.groups.close()
        self._comm_state()

    # ------------------------------------------------------------------ what the hook asks

    @property
    def accumulate(self) -> int:
        """Backward passes per communication (``gradient_merge_configs.k_steps``)."""
        return self.accumulation.k

    @property
    def passes(self) -> int:
        """Backward passes that reached the hook (the accumulation and gossip clocks)."""
        return self.accumulation.total

    def start_pass(self) -> bool:
        """A backward pass begins (its first bucket arrived): count it; True when it
        communicates (every ``accumulate``-th pass)."""
        with self._lock:
            return self.accumulation.begin()

    def name(self, p: torch.Tensor) -> str:
        return self.names.get(id(p), f"parameter {tuple(p.shape)}")

    def start(self, flat: torch.Tensor, index: int, params: Sequence[torch.Tensor]) -> tuple[Work, Any]:
        """Start averaging ``flat`` (DDP bucket ``index``); ``(work, finish)``: call ``finish()``
        after ``work.wait()`` to complete the bucket (gossip writes its elements back)."""
        if self.tuning is not None:
            if index == 0:
                self.collective = self.tuning.pass_begins()
            self.tuning.saw_bucket(index)
        if self.sampler is None:
            return self.collective.start_tensor(flat, index), None
        key = self._gossip_key(flat, params)
        sizes = [p.numel() for p in params]  # strided per parameter: DDP's bucket layout may change
        sent, where = self.sampler.encode(key, flat, step=self.accumulation.windows - 1, sizes=sizes)
        work = self.collective.start_tensor(sent, index)
        return work, lambda: self.sampler.decode(flat, sent, where)  # type: ignore[union-attr]

    def _gossip_key(self, flat: torch.Tensor, params: Sequence[torch.Tensor]) -> Hashable:
        """Residuals are keyed by the bucket's parameter names: DDP lays its buckets out again
        after the first step, and the residuals follow their parameters into the new layout."""
        assert self.sampler is not None
        key = tuple(self.name(p) for p in params)
        with self._lock:
            if key in self.sampler.residuals:
                return key
            mine = set(key)
            for old, res in list(self.sampler.residuals.items()):
                if mine.isdisjoint(old):  # type: ignore[arg-type]
                    continue  # another bucket of the same layout
                at = 0  # a new layout holds some of this old bucket's parameters: split it
                for name in old:  # type: ignore[union-attr]
                    size = self._param_sizes[name]
                    self._pool[name] = res[at: at + size]
                    at += size
                del self.sampler.residuals[old]
            if mine & self._pool.keys():
                parts = [self._pool.pop(n, None) for n in key]
                sizes = [p.numel() for p in params]
                res = torch.cat([t if t is not None else torch.zeros(s, dtype=flat.dtype) for t, s in zip(parts, sizes)])
                self.sampler.residuals[key] = res.to(flat.device)
        return key

    def record_sizes(self, params: Sequence[torch.Tensor]) -> None:
        """Remember each parameter's size by name (gossip splits old residuals by them)."""
        for p in params:
            self._param_sizes[self.name(p)] = p.numel()

    def finish_async(self, index: int, job: Any) -> None:
        """Run ``job`` on ring ``index``'s helper thread (bucket order kept per ring)."""
        assert self._finishers is not None
        self._finishers.submit(index, job)

    # ------------------------------------------------------------------ NaN check

    def check_finite(self, flat: torch.Tensor, params: Sequence[torch.Tensor], local_bad: list[str],
                     index: int) -> None:
        """Raise FloatingPointError when the averaged ``flat`` holds NaN/Inf, naming the
        parameters, this rank, and whether the values started here (``local_bad``: the
        parameters whose own gradient was non-finite before the allreduce)."""
        bad = self.non_finite(flat, params, self.name)
        if not bad:
            return
        rank = self.groups.world.rank if self.groups is not None else -1
        origin = (f"this rank's own gradient of {', '.join(local_bad)} was already non-finite: the "
                  "NaN/Inf began on this rank; look at its data and loss" if local_bad else
                  "this rank's own gradients were finite: it came from another rank (that rank's "
                  "error says where it began)")
        raise FloatingPointError(
            f"rank {rank}: the averaged gradient of {', '.join(bad) or 'a parameter'} contains NaN or "
            f"Inf after DDP bucket {index}'s allreduce; {origin} (FLEETLIKE_NAN_CHECK / "
            "strategy.check_nan_inf found it)"
        )

    @staticmethod
    def non_finite(flat: torch.Tensor, params: Sequence[torch.Tensor], name: Any) -> list[str]:
        """The names of ``params`` whose slice of DDP's bucket ``flat`` holds NaN/Inf (the
        core's check, `fleetlike.collectives.buckets.non_finite`)."""
        sizes = [p.numel() for p in params]
        views = flat.split([*sizes, flat.numel() - sum(sizes)])[:len(params)]
        return non_finite(flat, views, lambda i: name(params[i]))

    # ------------------------------------------------------------------ slow-rank check

    def bucket_launched(self) -> None:
        self._launched_at = time.perf_counter()

    def pass_done(self) -> None:
        """The last bucket of a pass finished (a helper thread): the next own-work window opens."""
        with self._lock:
            self._done_at = time.perf_counter()

    def perf_tick(self) -> None:
        """After the last bucket of a communicating pass was launched (autograd's thread, in the
        same order on every rank): add this pass's own work (from the previous pass's last bucket
        done to this one's last launch) to the core's `SlowRankWindow`, which gathers, judges
        and logs every ``perf_every`` passes as in every other face."""
        if self.perf is None:
            return
        with self._lock:
            busy = self._launched_at - self._done_at if self._done_at is not None else 0.0
        if self.perf.add(busy):
            assert self.health is not None
            report = self.perf.gather(self.health)
            self.step_times, self.data_wait, self.slow = report.step_times, report.data_wait, report.slow_ranks

    # ------------------------------------------------------------------ checkpoints

    def __getstate__(self) -> dict[str, Any]:
        """Everything but the communicators, threads and lock (as torch's PowerSGDState)."""
        return {
            "strategy": self.strategy.to_dict(),
            "explicit": self.strategy.explicit_options(),  # what the user set (the tuner leaves it)
            "passes": self.passes,
            "names": None,
            "gossip": self.sampler.state_dict() if self.sampler is not None else None,
            "param_sizes": dict(self._param_sizes),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(DistributedStrategy.from_dict(state["strategy"], state.get("explicit")))  # type: ignore[misc]
        self.accumulation.resume(int(state["passes"]))
        self._param_sizes = dict(state["param_sizes"])
        if state["gossip"] is not None and self.sampler is not None:
            self.sampler.load_state_dict(state["gossip"])

"""Mixed precision: autocast with custom op lists, and Paddle's dynamic loss scaling.

The forward runs under ``torch.autocast`` in float16 or bfloat16. ``custom_white_list`` /
``custom_black_list`` name torch operations (``"softmax"``, ``"layer_norm"``, ``"matmul"`` ...):
a `TorchFunctionMode` intercepts them and runs white-listed ops in the low dtype and black-listed
ones in float32, with autocast off for that call, as Paddle's lists do for its ops.

Loss scaling follows Paddle's ``update_loss_scaling`` rule step by step: start at
``init_loss_scaling``; after ``incr_every_n_steps`` consecutive finite steps multiply by
``incr_ratio`` (if the result is finite); after ``decr_every_n_nan_or_inf`` consecutive
non-finite steps multiply by ``decr_ratio``, never below 1; a non-finite step resets the good
count, a finite one the bad count; a non-finite step is skipped. Whether a step is finite is
decided over all ranks by one 1-element max-allreduce, so every rank skips the same steps even
when only one of them overflowed. With ``use_dynamic_loss_scaling=False`` the scale stays fixed
(non-finite steps are still skipped). bfloat16 has float32's range: no scaling, no unscale, no
finite check (and no extra collective) at all.

Both faces run the same `AmpUnit`. Program style: ``loss_fn`` runs under autocast and the
backward op scales the loss. Eager style: the wrapped model's forward runs under autocast (or the
user's own code under ``fleet.autocast()``); ``optimizer.backward(loss)`` scales the loss, and a
plain ``loss.backward()`` works too: gradient hooks multiply the gradient entering a wrapped
model by the scale and divide the gradient leaving it through its inputs, which is the same as
scaling the loss for every parameter the wrapped models own. ``optimizer.step()`` unscales, checks, updates or skips, and moves
the scale.

Example:
    >>> s.amp = True; s.amp_configs = {"init_loss_scaling": 1024, "dtype": "float16"}
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import logging
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from fleetlike.comm import Communicator
from fleetlike.comm import dtype_name
from fleetlike.program import StepState
from fleetlike.strategies.amp_policy import AdaptiveAmpPolicy
from fleetlike.strategies.step import EXPLICIT_SCALING, AppliedEntry, Hook, StepContext, Unit

log = logging.getLogger("fleetlike")

__all__ = ["AmpUnit", "policy_from_config", "LossScaler", "OpListMode", "autocast", "scaler_from_config", "check_op_names", "known_op_names", "unscale_and_check"]


def known_op_names() -> set[str]:
    """Names an op list may use: public functions of torch, torch.nn.functional and Tensor."""
    names = {n for n in dir(torch) if not n.startswith("_")}
    names |= {n for n in dir(F) if not n.startswith("_")}
    names |= {n for n in dir(torch.Tensor) if not n.startswith("_")}
    return names


def check_op_names(field: str, names: Sequence[str]) -> None:
    """Raise ValueError naming unknown entries of an op list, with close matches."""
    known = known_op_names()
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ValueError(
                f"amp_configs.{field} names {name!r}, which is not a torch operation{hint}"
            )


class OpListMode(TorchFunctionMode):
    """Runs white-listed ops in ``dtype`` and black-listed ones in float32, autocast off."""

    def __init__(self, dtype: torch.dtype, white: Iterable[str], black: Iterable[str], device_type: str) -> None:
        super().__init__()
        self.dtype = dtype
        self.white = frozenset(white)
        self.black = frozenset(black)
        self.device_type = device_type

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in self.black or name in self.white:
            target = torch.float32 if name in self.black else self.dtype

            def cast(x: Any) -> Any:
                return x.to(target) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

            with torch.autocast(self.device_type, enabled=False):
                return func(*[cast(a) for a in args], **{k: cast(v) for k, v in kwargs.items()})
        return func(*args, **kwargs)


@dataclasses.dataclass
class LossScaler:
    """Paddle's dynamic loss-scaling state machine (see the module docstring)."""

    scale: float
    incr_every_n_steps: int = 1000
    decr_every_n_nan_or_inf: int = 2
    incr_ratio: float = 2.0
    decr_ratio: float = 0.8
    dynamic: bool = True
    good_steps: int = 0
    bad_steps: int = 0
    skipped_steps: int = 0

    def update(self, found_inf: bool) -> None:
        """Advance one step given whether (any rank's) gradients were non-finite."""
        if found_inf:
            self.skipped_steps += 1
        if not self.dynamic:
            return
        if found_inf:
            self.good_steps = 0
            self.bad_steps += 1
            if self.bad_steps == self.decr_every_n_nan_or_inf:
                self.scale = max(self.scale * self.decr_ratio, 1.0)
                self.bad_steps = 0
        else:
            self.bad_steps = 0
            self.good_steps += 1
            if self.good_steps == self.incr_every_n_steps:
                bigger = self.scale * self.incr_ratio
                if math.isfinite(bigger):
                    self.scale = bigger
                self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def unscale_and_check(grads: Sequence[torch.Tensor], scale: float, world: Communicator) -> bool:
    """Divide ``grads`` by ``scale`` in place; True when any rank has a non-finite gradient."""
    flag = torch.zeros(1, dtype=torch.float32, device=world.device)
    inv = 1.0 / scale
    for g in grads:
        if scale != 1.0:
            g.mul_(inv)
        if not torch.isfinite(g).all():
            flag.fill_(1.0)
    world.all_reduce(flag, "max", agreed=True)
    return bool(flag.item() > 0)


def scaler_from_config(cfg: Any) -> tuple[LossScaler, torch.dtype]:
    """The loss scaler and autocast dtype for ``strategy.amp_configs`` (bfloat16: scale 1, fixed)."""
    dtype = torch.float16 if cfg["dtype"] == "float16" else torch.bfloat16
    scaling = dtype == torch.float16
    scaler = LossScaler(
        scale=float(cfg["init_loss_scaling"]) if scaling else 1.0,
        incr_every_n_steps=int(cfg["incr_every_n_steps"]),
        decr_every_n_nan_or_inf=int(cfg["decr_every_n_nan_or_inf"]),
        incr_ratio=float(cfg["incr_ratio"]),
        decr_ratio=float(cfg["decr_ratio"]),
        dynamic=bool(cfg["use_dynamic_loss_scaling"]) and scaling,
    )
    return scaler, dtype


def policy_from_config(cfg: Any) -> AdaptiveAmpPolicy | None:
    """``amp_configs.policy`` as an `AdaptiveAmpPolicy` counting optimizer steps (None: always on)."""
    if str(cfg["policy"]) == "always":
        return None
    end = int(cfg["policy_end_time"])
    return AdaptiveAmpPolicy(
        str(cfg["policy"]), start_time=int(cfg["policy_start_time"]), end_time=end or None,
        hold_time=int(cfg["policy_hold_time"]), interval_time=int(cfg["policy_interval_time"]),
        interval_hold_time=int(cfg["policy_interval_hold_time"]),
        loss_fast=float(cfg["policy_loss_fast"]), loss_slow=float(cfg["policy_loss_slow"]))


@contextlib.contextmanager
def autocast(cfg: Any, device_type: str) -> Iterator[None]:
    """``torch.autocast`` in ``amp_configs.dtype`` plus the custom white/black op lists."""
    dtype = torch.float16 if cfg["dtype"] == "float16" else torch.bfloat16
    white, black = list(cfg["custom_white_list"]), list(cfg["custom_black_list"])
    with torch.autocast(device_type, dtype=dtype), OpListMode(dtype, white, black, device_type):
        yield


class AmpUnit(Unit):
    """Autocast the forward, scale the loss, unscale + agreed finite check, update the scale."""

    name = "amp"

    def __init__(self, ctx: StepContext) -> None:
        cfg = ctx.strategy.amp_configs
        check_op_names("custom_white_list", list(cfg["custom_white_list"]))
        check_op_names("custom_black_list", list(cfg["custom_black_list"]))
        self.ctx = ctx
        self.cfg = cfg
        self.scaler, self.dtype = scaler_from_config(cfg)
        #: float16 scales; bfloat16 has float32's range: no scale, nothing to unscale or skip
        self.scaling = self.dtype == torch.float16
        self.policy = policy_from_config(cfg)
        #: whether AMP acts in this step (the policy decides at each step's begin)
        self.enabled = True
        #: optimizer steps taken (the policy's time; micro-steps of gradient merge do not count)
        self.steps = 0
        self._last_loss: float | None = None
        # the finite check and the scale act at the update; 'time_lr' reads the optimizer's lr
        self.needs_optimizer = self.scaling or (self.policy is not None and self.policy.policy == "time_lr")
        self.found_inf = False
        #: optimizer steps logged by amp_configs.debug_log
        self._logged = 0
        ctx.record("amp", True, f"autocast {dtype_name(self.dtype)}, " + (
            "dynamic loss scaling" if self.scaler.dynamic
            else ("fixed loss scale" if self.scaling else "no loss scaling (bfloat16)")))
        self.policy_entry: AppliedEntry | None = None
        if self.policy is not None:
            self.policy_entry = AppliedEntry("amp_configs.policy", True, f"{self.policy.policy}: not decided yet")
            ctx.applied.append(self.policy_entry)

    def hooks(self) -> list[Hook]:
        hooks: list[Hook] = []
        if self.policy is not None:
            hooks.append(Hook("begin", "amp_policy", self._decide, {
                "policy": self.policy.policy, "amp": lambda: "on" if self.enabled else "off"}))
        if self.scaling:
            world = self.ctx.groups.world
            hooks += [
                Hook("synchronize", "check_finite_and_unscale", self._check, {"agreed_on": world.name}),
                Hook("after_update", "update_loss_scaling", self._update,
                     {"dynamic": self.scaler.dynamic, "scale": lambda: self.scaler.scale}),
            ]
        if self.cfg["debug_log"]:
            hooks.append(Hook("after_update", "amp_debug_log", self._debug_log, {"to": "stderr"}))
        if self.policy is not None:
            hooks.append(Hook("after_update", "amp_policy_step", self._count, {
                "time": "optimizer steps", **({"loss": "averaged over ranks"} if self.policy.policy == "loss" else {})}))
        return hooks

    def _decide(self, st: StepState) -> None:
        """At each step's begin: AMP on or off for this step (every rank decides alike: time and
        lr agree, and the loss the 'loss' policy reads is averaged over the ranks)."""
        assert self.policy is not None
        lr = None
        if self.policy.policy == "time_lr":
            lr = float(self.ctx.need_optimizer("amp_configs.policy='time_lr'").param_groups[0]["lr"])
        before = len(self.policy.switches)
        self.enabled, why = self.policy.decide(self.steps + 1, lr, self._last_loss)
        if len(self.policy.switches) != before and self.policy_entry is not None:
            n = len(self.policy.switches)
            self.policy_entry.detail = (f"{self.policy.policy}: AMP {'on' if self.enabled else 'off'} since step "
                                        f"{self.steps + 1} ({why}); {n} switch(es)")
            log.info("amp policy %s: AMP %s at step %d (%s)", self.policy.policy,
                     "on" if self.enabled else "off", self.steps + 1, why)
        st.info["amp_enabled"] = self.enabled

    def _count(self, st: StepState) -> None:
        if st.accumulate:
            return
        self.steps += 1
        if self.policy is not None and self.policy.policy == "loss":
            if st.loss is None:
                raise ValueError(
                    "amp_configs.policy='loss' decides from the loss, but this step had none: pass it as "
                    "optimizer.step(loss=loss), or call optimizer.backward(loss) (program style: loss_fn "
                    "returns it)")
            value = float(st.loss.detach()) if isinstance(st.loss, torch.Tensor) else float(st.loss)
            t = torch.tensor([value], dtype=torch.float64, device=self.ctx.device)
            self._last_loss = float(self.ctx.groups.world.all_reduce(t, "avg", agreed=True).item())

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        with autocast(self.cfg, self.ctx.device.type):
            yield

    def forward_attrs(self) -> dict[str, Any]:
        return {"autocast": dtype_name(self.dtype)}

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss.float() * self.scaler.scale if self.scaling and self.enabled else loss

    def backward_attrs(self) -> dict[str, Any]:
        return {"loss_scale": lambda: self.scaler.scale} if self.scaling else {}

    def outputs(self, st: StepState, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
        """Plain ``loss.backward()``: the gradient entering the model is multiplied by the scale
        and the gradient leaving it through its inputs divided again, so every wrapped model's
        parameters get exactly scale x their gradient whatever the graph between the models
        (a chain, a GAN's D(G(z)), independent models), and what lies outside them stays true."""
        if not self.scaling or not self.enabled:
            return
        scaler = self.scaler

        def scale(grad: torch.Tensor) -> torch.Tensor:
            return grad if EXPLICIT_SCALING else (grad.float() * scaler.scale).to(grad.dtype)

        def unscale(grad: torch.Tensor) -> torch.Tensor:
            return grad if EXPLICIT_SCALING else (grad.float() / scaler.scale).to(grad.dtype)

        for t in outputs:
            if t.is_floating_point():
                t.register_hook(scale)
        for t in inputs:
            if t.is_floating_point():
                t.register_hook(unscale)

    def _check(self, st: StepState) -> None:
        if st.accumulate:
            return
        if not self.enabled:  # AMP off this step: nothing was scaled, the scaler waits
            self.found_inf = False
            st.info["found_inf"] = False
            return
        self.found_inf = unscale_and_check(self.ctx.grads(), self.scaler.scale, self.ctx.groups.world)
        st.skip_update = st.skip_update or self.found_inf
        st.info["found_inf"] = self.found_inf

    def _update(self, st: StepState) -> None:
        if not st.accumulate:
            if self.enabled:
                self.scaler.update(self.found_inf)
            st.info["loss_scale"] = self.scaler.scale

    def _debug_log(self, st: StepState) -> None:
        """EPL's ``amp.debug_log``: one line per optimizer step (micro-steps of gradient merge
        are not steps), rank-tagged, with what AMP did."""
        if st.accumulate:
            return
        self._logged += 1
        what = ("off this step (amp_configs.policy)" if not self.enabled
                else "skipped: inf/NaN gradients" if self.found_inf else "applied")
        print(f"fleetlike amp [rank {self.ctx.groups.world.rank}] step {self._logged}: {dtype_name(self.dtype)}, "
              f"loss scale {self.scaler.scale:g}, update {what}", file=sys.stderr, flush=True)

    def notes(self) -> list[Callable[[], str]]:
        return [lambda: f"amp {dtype_name(self.dtype)}: loss scale {self.scaler.scale:g}, "
                        f"skipped {self.scaler.skipped_steps} steps"]

    def state_dict(self) -> dict[str, Any]:
        state = self.scaler.state_dict()
        if self.policy is not None:
            state["policy"] = {**self.policy.state_dict(), "steps": self.steps, "enabled": self.enabled,
                               "world_loss": self._last_loss}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        policy = state.pop("policy", None)
        if (policy is None) != (self.policy is None):
            raise ValueError(
                "AMP state: the checkpoint was written " + ("with" if policy is not None else "without")
                + " amp_configs.policy but this job runs " + ("with" if self.policy is not None else "without")
                + " one; restart with the saved strategy")
        self.scaler.load_state_dict(state)
        if policy is not None and self.policy is not None:
            self.steps, self.enabled, self._last_loss = int(policy["steps"]), bool(policy["enabled"]), policy["world_loss"]
            self.policy.load_state_dict(policy)

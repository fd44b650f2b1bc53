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

Example:
    >>> s.amp = True; s.amp_configs = {"init_loss_scaling": 1024, "dtype": "float16"}
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from fleetlike.comm import Communicator
from fleetlike.program import Op, Program, StepState

if TYPE_CHECKING:
    from fleetlike.strategies.compose import Build

__all__ = ["LossScaler", "OpListMode", "amp_pass", "scaler_from_config", "check_op_names", "known_op_names", "unscale_and_check"]


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
    flag = torch.zeros(1, dtype=torch.float32, device=grads[0].device if grads else "cpu")
    inv = 1.0 / scale
    for g in grads:
        if scale != 1.0:
            g.mul_(inv)
        if not torch.isfinite(g).all():
            flag.fill_(1.0)
    world.all_reduce(flag, "max")
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


def amp_pass(program: Program, build: Build) -> Program:
    """Autocast the forward, scale the loss, unscale + agreed finite check, update the scale."""
    cfg = build.strategy.amp_configs
    white, black = list(cfg["custom_white_list"]), list(cfg["custom_black_list"])
    check_op_names("custom_white_list", white)
    check_op_names("custom_black_list", black)
    scaler, dtype = scaler_from_config(cfg)
    scaling = dtype == torch.float16
    build.states["amp"] = scaler
    device_type = build.device.type
    main = program.clone()

    i = main.index("forward")
    plain_forward = main.ops[i].fn
    assert plain_forward is not None

    def forward(st: StepState) -> None:
        with torch.autocast(device_type, dtype=dtype), OpListMode(dtype, white, black, device_type):
            plain_forward(st)

    main.ops[i] = Op("forward", forward, {**main.ops[i].attrs, "autocast": str(dtype).replace("torch.", "")})

    def backward(st: StepState) -> None:
        assert st.loss is not None
        (st.loss.float() * scaler.scale).backward() if scaling else st.loss.backward()

    main.replace("backward", Op("backward", backward, {"loss_scale": lambda: scaler.scale} if scaling else {}))
    found = {"inf": False}

    def check(st: StepState) -> None:
        if st.accumulate:
            return
        grads = (
            [b.buffer for b in build.reducer.buckets]
            if build.reducer is not None
            else [p.grad for p in build.model.parameters() if p.grad is not None]
        )
        found["inf"] = unscale_and_check(grads, scaler.scale, build.groups.world)
        st.skip_update = st.skip_update or found["inf"]
        st.info["found_inf"] = found["inf"]

    def update_scale(st: StepState) -> None:
        if not st.accumulate:
            scaler.update(found["inf"])
            st.info["loss_scale"] = scaler.scale

    if scaling:  # bfloat16 has float32's range: no scale, nothing to unscale or skip
        main.insert_before(
            "optimizer_update",
            Op("check_finite_and_unscale", check, {"agreed_on": build.groups.world.name}),
        )
        main.insert_after(
            "optimizer_update",
            Op("update_loss_scaling", update_scale, {"dynamic": scaler.dynamic, "scale": lambda: scaler.scale}),
        )
    main.notes.append(lambda: f"amp {str(dtype).replace('torch.', '')}: loss scale {scaler.scale:g}, skipped {scaler.skipped_steps} steps")
    build.record("amp", True, f"autocast {str(dtype).replace('torch.', '')}, " + (
        "dynamic loss scaling" if scaler.dynamic else ("fixed loss scale" if scaling else "no loss scaling (bfloat16)")))
    return main

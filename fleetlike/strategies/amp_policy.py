"""TI-ACC's adaptive mixed precision: decide, step by step or epoch by epoch, whether AMP is on.

Mixed precision is fastest but least forgiving where training is fragile (the first epochs, the
epochs after a learning-rate drop, stretches where the loss misbehaves). TI-ACC (seed 001) ships
``MixedPrecision_TrainingPolicy`` with three policies; its documentation gives their parameters
but not their exact rules, so here they are, precisely (``t`` is the caller's time: epochs in
TI-ACC's example, optimizer steps when the policy comes from ``amp_configs.policy``):

- ``time`` (TI-ACC 0): AMP on while ``start_time <= t <= end_time`` (no end if ``end_time`` is
  None), off outside. Typical: fp32 for the first 10 epochs, AMP from then on.
- ``time_lr`` (TI-ACC 1): as ``time``, but for ``hold_time`` after every learning-rate change
  (``t_change <= t < t_change + hold_time``) AMP is off: the loss often swings after a decay.
- ``loss`` (TI-ACC 2): acts in windows ``[j * interval_time, j * interval_time +
  interval_hold_time)``, ``j >= 1``, and leaves AMP on outside them. Inside a window AMP is off
  when the loss, relative to the previous call's, fell faster than ``loss_fast`` or slower than
  ``loss_slow`` (rose, with the default 0): ``d = (previous - loss) / |previous|``, abnormal if
  ``d > loss_fast or d < loss_slow``. With no previous loss there is no evidence: on.

``always`` (the default of ``amp_configs.policy``) is AMP on at every step.

Example (TI-ACC's loop, with torch's GradScaler):
    >>> policy = AdaptiveAmpPolicy("time_lr", start_time=10, end_time=90, hold_time=5)
    >>> for epoch in range(100):
    ...     on = policy.enable_mixed_precision(epoch, lr=sched.get_last_lr()[0])
    ...     with torch.autocast("cuda", enabled=on): loss = model(x).loss
"""

from __future__ import annotations

import math
import threading
from typing import Any

__all__ = ["AdaptiveAmpPolicy", "POLICIES", "MixedPrecision_TrainingPolicy"]

#: TI-ACC's integer codes and fleetlike's names
POLICIES = {0: "time", 1: "time_lr", 2: "loss"}
_NAMES = ("always", "time", "time_lr", "loss")


def _number(name: str, value: Any, *, minimum: float | None = None, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"AdaptiveAmpPolicy: {name}={value!r} must be a finite number"
                        + (" or None" if allow_none else ""))
    if minimum is not None and value < minimum:
        raise ValueError(f"AdaptiveAmpPolicy: {name}={value!r} must be >= {minimum:g}")
    return float(value)


class AdaptiveAmpPolicy:
    """TI-ACC's adaptive mixed-precision policy (see the module docstring for the rules).

    Args:
        policy: "always", "time", "time_lr", "loss", or TI-ACC's 0 / 1 / 2.
        start_time, end_time: the AMP window of "time" and "time_lr" (end None: no end).
        hold_time: "time_lr": how long AMP stays off after a learning-rate change (required).
        interval_time, interval_hold_time: "loss": its windows.
        loss_fast, loss_slow: "loss": the normal band of the relative loss decrease per call.

    Thread-safe: a data-loading or logging thread may read ``switches`` while training decides.
    """

    def __init__(self, policy: str | int, start_time: float = 10, end_time: float | None = None,
                 hold_time: float | None = None, interval_time: float = 1000,
                 interval_hold_time: float = 100, loss_fast: float = 0.5, loss_slow: float = 0.0) -> None:
        if isinstance(policy, int) and not isinstance(policy, bool):
            if policy not in POLICIES:
                raise ValueError(f"AdaptiveAmpPolicy: policy={policy!r} is not one of TI-ACC's 0 (time), "
                                 "1 (time_lr), 2 (loss)")
            policy = POLICIES[policy]
        if policy not in _NAMES:
            raise ValueError(f"AdaptiveAmpPolicy: policy={policy!r} is not one of {', '.join(map(repr, _NAMES))} "
                             "(or TI-ACC's 0, 1, 2)")
        self.policy = str(policy)
        self.start_time = _number("start_time", start_time, minimum=0)
        self.end_time = _number("end_time", end_time, allow_none=True)
        if self.end_time is not None and self.end_time < float(self.start_time or 0):
            raise ValueError(f"AdaptiveAmpPolicy: end_time={end_time!r} is before start_time={start_time!r}")
        if self.policy == "time_lr" and hold_time is None:
            raise ValueError("AdaptiveAmpPolicy: policy 'time_lr' (TI-ACC 1) needs hold_time: how long AMP "
                             "stays off after a learning-rate change, e.g. the epochs the loss swings")
        self.hold_time = _number("hold_time", hold_time, minimum=0, allow_none=True)
        self.interval_time = _number("interval_time", interval_time, minimum=1e-12)
        self.interval_hold_time = _number("interval_hold_time", interval_hold_time, minimum=0)
        self.loss_fast = _number("loss_fast", loss_fast)
        self.loss_slow = _number("loss_slow", loss_slow)
        if float(self.loss_slow or 0) > float(self.loss_fast or 0):
            raise ValueError(f"AdaptiveAmpPolicy: loss_slow={loss_slow!r} is above loss_fast={loss_fast!r}; "
                             "the normal band is loss_slow <= decrease <= loss_fast")
        self._lock = threading.Lock()
        self._last_lr: float | None = None
        self._lr_changed_at: float | None = None
        self._last_loss: float | None = None
        self._on: bool | None = None
        #: ``(time, on, why)`` for every decision that changed the answer
        self.switches: list[tuple[float, bool, str]] = []

    def decide(self, time: float, lr: float | None = None, loss: float | None = None) -> tuple[bool, str]:
        """``(on, why)`` at ``time``; ``lr`` (needed by "time_lr") and ``loss`` (needed by
        "loss": the loss since the previous call) advance the policy's memory."""
        with self._lock:
            on, why = self._rule(float(time), lr, loss)
            if on != self._on:
                self.switches.append((float(time), on, why))
                self._on = on
            return on, why

    def enable_mixed_precision(self, epoch: float, lr: float | None = None, loss: float | None = None,
                               scaler: Any = None) -> bool:
        """TI-ACC's call: whether AMP is on for ``epoch``. ``scaler`` (TI-ACC passes its
        GradScaler) is accepted for compatibility: the scaler keeps its state while AMP is off,
        nothing here needs to touch it."""
        return self.decide(epoch, lr, loss)[0]

    def _in_window(self, t: float) -> bool:
        start = float(self.start_time or 0)
        return t >= start and (self.end_time is None or t <= self.end_time)

    def _rule(self, t: float, lr: float | None, loss: float | None) -> tuple[bool, str]:
        if self.policy == "always":
            return True, "always"
        if self.policy == "time":
            return (True, "inside the AMP window") if self._in_window(t) else (False, "outside the AMP window")
        if self.policy == "time_lr":
            if lr is None:
                raise ValueError("AdaptiveAmpPolicy 'time_lr' needs the learning rate at every call: pass lr=")
            if self._last_lr is not None and float(lr) != self._last_lr:
                self._lr_changed_at = t
            self._last_lr = float(lr)
            if not self._in_window(t):
                return False, "outside the AMP window"
            if self._lr_changed_at is not None and t < self._lr_changed_at + float(self.hold_time or 0):
                return False, f"held off for {self.hold_time:g} after the lr change at {self._lr_changed_at:g}"
            return True, "inside the AMP window"
        # loss
        previous, self._last_loss = self._last_loss, (None if loss is None else float(loss))
        interval, hold = float(self.interval_time or 1), float(self.interval_hold_time or 0)
        j = math.floor(t / interval)
        if j < 1 or t >= j * interval + hold:
            return True, "outside the loss-check windows"
        if previous is None or loss is None or previous == 0 or not math.isfinite(previous) or not math.isfinite(loss):
            return True, "loss-check window, no previous loss to compare"
        d = (previous - float(loss)) / abs(previous)
        if d > float(self.loss_fast or 0):
            return False, f"loss fell {d:.3g} (> loss_fast {self.loss_fast:g})"
        if d < float(self.loss_slow or 0):
            return False, f"loss fell {d:.3g} (< loss_slow {self.loss_slow:g})"
        return True, f"loss fell {d:.3g}, inside [{self.loss_slow:g}, {self.loss_fast:g}]"

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"last_lr": self._last_lr, "lr_changed_at": self._lr_changed_at,
                    "last_loss": self._last_loss, "on": self._on, "switches": list(self.switches)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            self._last_lr, self._lr_changed_at = state["last_lr"], state["lr_changed_at"]
            self._last_loss, self._on = state["last_loss"], state["on"]
            self.switches = [tuple(s) for s in state["switches"]]  # type: ignore[misc]


#: TI-ACC's example names of the parameters, in the example's positional order, and the
#: parameter table's names for the same values
_EXAMPLE_ORDER = ("start_step", "hold_step", "end_step", "test_interval", "test_step")
_TABLE_NAME = {"start_step": "start_time", "hold_step": "hold_time", "end_step": "end_time",
               "test_interval": "interval_time", "test_step": "interval_hold_time"}
_TABLE_DEFAULTS: dict[str, Any] = {"start_time": 10, "end_time": None, "hold_time": None, "interval_time": 1000,
                                   "interval_hold_time": 100}


def _is_scaler(value: Any) -> bool:
    """A GradScaler (torch.cuda.amp's, torch.amp's, or one with its interface), not a number."""
    return value is not None and not isinstance(value, (int, float)) and all(
        callable(getattr(value, name, None)) for name in ("scale", "update"))


class MixedPrecision_TrainingPolicy(AdaptiveAmpPolicy):  # noqa: N801 - TI-ACC's own name
    """TI-ACC's class, taking both of its documented calls:

    - the example's positional one, ``MixedPrecision_TrainingPolicy(policy, start_step, hold_step,
      end_step, test_interval, test_step)`` (keywords of those names work too);
    - the parameter table's keywords, ``MixedPrecision_TrainingPolicy(policy, start_time=10,
      end_time=None, hold_time=None, interval_time=1000, interval_hold_time=100)``.

    A value given twice (positionally and by a keyword, or by both names) is a TypeError.

    Example:
        >>> p = MixedPrecision_TrainingPolicy(1, 2, 3, 8, 1000, 100)   # time_lr, start 2, hold 3, end 8
        >>> (p.start_time, p.hold_time, p.end_time)
        (2.0, 3.0, 8.0)
    """

    def __init__(self, policy: str | int, *args: Any, **kwargs: Any) -> None:
        if len(args) > len(_EXAMPLE_ORDER):
            raise TypeError(f"MixedPrecision_TrainingPolicy takes policy and at most {len(_EXAMPLE_ORDER)} values "
                            f"({', '.join(_EXAMPLE_ORDER)}), got {1 + len(args)}")
        values: dict[str, Any] = {}
        for name, value in zip(_EXAMPLE_ORDER, args):
            values[_TABLE_NAME[name]] = value
        for name, value in kwargs.items():
            table = _TABLE_NAME.get(name, name)
            if table not in _TABLE_DEFAULTS:
                raise TypeError(f"MixedPrecision_TrainingPolicy got an unexpected keyword {name!r}; its parameters are "
                                f"{', '.join(_TABLE_DEFAULTS)} (the table's names) or {', '.join(_EXAMPLE_ORDER)} "
                                "(the example's)")
            if table in values:
                raise TypeError(f"MixedPrecision_TrainingPolicy got {table} twice ({name!r} and an earlier "
                                "positional value or other name); give it once")
            values[table] = value
        super().__init__(policy, **{**_TABLE_DEFAULTS, **values})

    def enable_mixed_precision(self, epoch: float, *args: Any, lr: float | None = None,  # type: ignore[override]
                               loss: float | None = None, scaler: Any = None) -> bool:
        """Whether AMP is on for ``epoch``, in both of TI-ACC's forms: the example's
        ``(epoch, lr, loss, scaler=scaler)`` and the table's ``(epoch, scaler, lr=None,
        loss=None)`` (told apart by the second argument: a GradScaler or a number)."""
        given: dict[str, Any] = {}
        order = ("scaler", "lr", "loss") if args and _is_scaler(args[0]) else ("lr", "loss", "scaler")
        if len(args) > 3:
            raise TypeError("enable_mixed_precision takes epoch and at most lr, loss and scaler")
        for name, value in zip(order, args):
            given[name] = value
        for name, value in (("lr", lr), ("loss", loss), ("scaler", scaler)):
            if value is not None:
                if name in given:
                    raise TypeError(f"enable_mixed_precision got {name} twice; give it once")
                given[name] = value
        if given.get("lr") is not None and _is_scaler(given["lr"]):
            raise TypeError("enable_mixed_precision: lr is a GradScaler; pass (epoch, lr, loss, scaler=scaler) or "
                            "(epoch, scaler, lr=..., loss=...)")
        return super().enable_mixed_precision(epoch, given.get("lr"), given.get("loss"), given.get("scaler"))

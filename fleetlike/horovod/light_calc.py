"""Light's compute names (``light.calc``; ``light.pytorch.trainer_calc``) for PyTorch.

(This module is `fleetlike.horovod.light_calc`; ``fleetlike.calc`` is the same module under Light's name.)

* `set_cudnn_autotune`: cuDNN tries the convolution and matmul algorithms in the first steps and
  keeps the fastest (``torch.backends.cudnn.benchmark``): later steps run faster, the first ones
  slower; worth it where input shapes stay fixed.
* `FusedOptimizer`: Light's "fused optimizer" (kernel fusion: fewer kernel launches per
  ``step()``) on torch's own multi-tensor kernels: the wrapped optimizer's parameter groups are
  switched to torch's ``fused=True`` implementation where its class and the parameters' device
  have one (Adam, AdamW, SGD, Adagrad on CPU and CUDA), else to ``foreach=True`` (every other
  optimizer of ``torch.optim`` that has it); an optimizer with neither (LBFGS, SparseAdam) is
  refused, naming why. The update is the same arithmetic as the per-tensor loop.

Change ``from light.pytorch.trainer_calc import FusedOptimizer`` to
``from fleetlike.calc import FusedOptimizer`` and ``light.calc`` to ``fleetlike.calc``.

Example:
    >>> from fleetlike.calc import FusedOptimizer, set_cudnn_autotune
    >>> set_cudnn_autotune()
    >>> optimizer = FusedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    >>> optimizer.origin_optimizer.param_groups[0]["params"]   # the wrapped optimizer, as Light's
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

__all__ = ["FusedOptimizer", "set_cudnn_autotune"]

_KERNELS = ("fused", "foreach")


def set_cudnn_autotune() -> None:
    """Turn cuDNN's algorithm search on for the rest of the process (Light's name for
    ``torch.backends.cudnn.benchmark = True``)."""
    torch.backends.cudnn.benchmark = True


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _choose(optimizer: torch.optim.Optimizer) -> str:
    """"fused" where torch's constructor accepts it for these parameters, else "foreach"."""
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    # defaults may hold entries the constructor does not take (AdamW's decoupled_weight_decay)
    hyper = {k: v for k, v in optimizer.defaults.items() if k not in _KERNELS and k in accepted}
    if "fused" in optimizer.defaults:
        try:  # torch's own checks (device, dtype, differentiable, ...) decide, on a throwaway copy
            probe = cls([torch.nn.Parameter(torch.empty(0, dtype=p.dtype, device=p.device))
                         for p in _params(optimizer)[:1]] or [torch.nn.Parameter(torch.empty(0))],
                        **hyper, fused=True, foreach=False)
            del probe
            return "fused"
        except (RuntimeError, ValueError, TypeError):
            pass
    if "foreach" in optimizer.defaults:
        return "foreach"
    raise TypeError(f"FusedOptimizer: torch.optim.{cls.__name__} has neither a fused nor a foreach "
                    "(multi-tensor) implementation, so there is nothing to fuse; use it unwrapped")


class FusedOptimizer:
    """``optimizer`` on torch's fused (or foreach) kernels; see the module doc. Wrap it after
    ``model.to(device)``: the kernels need the parameters where they will live.

    ``zero_grad``, ``step``, ``state_dict``, ``load_state_dict`` and ``param_groups`` are the
    wrapped optimizer's; ``origin_optimizer`` is the optimizer itself. A ``state_dict`` is the
    wrapped optimizer's as it was built (its kernel flags as given), so it loads into a plain
    optimizer of the same class and back.
    """

    def __init__(self, origin_optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(origin_optimizer, torch.optim.Optimizer):
            raise TypeError(f"FusedOptimizer wraps a torch.optim.Optimizer, got {type(origin_optimizer).__name__}")
        if isinstance(origin_optimizer, FusedOptimizer):
            raise TypeError("FusedOptimizer got a FusedOptimizer; wrap the plain optimizer once")
        self.origin_optimizer = origin_optimizer
        #: "fused" or "foreach": the torch implementation every parameter group now runs
        self.kernel = _choose(origin_optimizer)
        #: each group's kernel flags as given, for `state_dict`
        self._given = [{k: g.get(k) for k in _KERNELS if k in g} for g in origin_optimizer.param_groups]
        self._switch()

    def _switch(self) -> None:
        for group in self.origin_optimizer.param_groups:
            if "fused" in group:
                group["fused"] = self.kernel == "fused"
            if "foreach" in group:
                group["foreach"] = self.kernel == "foreach"
        if self.kernel == "fused":
            # torch sets it in a fused optimizer's constructor: GradScaler then unscales inside step
            self.origin_optimizer._step_supports_amp_scaling = True  # type: ignore[attr-defined]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.origin_optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.origin_optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.origin_optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> Any:
        return self.origin_optimizer.step(closure)

    def state_dict(self) -> dict[str, Any]:
        state = self.origin_optimizer.state_dict()
        for group, given in zip(state["param_groups"], self._given):
            group.update(given)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.origin_optimizer.load_state_dict(state_dict)
        self._given = [{k: g.get(k) for k in _KERNELS if k in g} for g in self.origin_optimizer.param_groups]
        self._switch()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.origin_optimizer.add_param_group(param_group)
        self._given.append({k: param_group.get(k, self.origin_optimizer.defaults.get(k)) for k in _KERNELS
                            if k in self.origin_optimizer.defaults})
        self._switch()

    def __repr__(self) -> str:
        return f"FusedOptimizer({self.kernel}: {self.origin_optimizer!r})"

"""The optimizer update's temporaries: bytes an ``optimizer.step()`` allocates and frees.

A step's peak is not only what a rank keeps: the update makes tensors of its own while it runs,
and how many depends on which of torch.optim's three implementations steps the parameters:

* **single-tensor** (``foreach=False``; torch's default for CPU tensors): one parameter at a
  time, so the temporaries are a few copies of the *largest* parameter stepped. Adam and AdamW
  build ``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)``: the square root and
  the quotient coexist, 2 copies; Adam's coupled weight decay adds ``grad.add(param)``, a third;
  SGD's coupled weight decay and Nesterov's ``grad.add(buf)`` one each.
* **multi-tensor** (``foreach=True``; torch's default for CUDA tensors): every parameter of a
  call at once, so the temporaries are copies of the *sum* of the parameters one call steps
  (the whole model, or the largest of ``num_apply_group``'s groups): Adam/AdamW's
  ``_foreach_sqrt(exp_avg_sqs)``, 1 copy (Adam's coupled weight decay makes its copy of the
  gradients before it and deletes it first); SGD's weight decay ``_foreach_add``, 1 copy
  (Nesterov adds in place into it).
* **fused** (``fused=True``): one kernel, no temporaries.

The counts are read from torch.optim's code (torch 2.13) and checked against the peak RSS of
real ranks (tests/test_plan_zero.py). An optimizer not listed here is counted as Adam's
single-tensor rule (2 copies of the largest parameter, `DEFAULT_COPIES`) and named in
`UpdateTemporaries.rule`.

Example:
    >>> update_temporaries(torch.optim.AdamW(model.parameters()), stepped).bytes
    8388608                              # 2 x the largest parameter (4 MiB), single-tensor
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch.optim.optimizer import _default_to_fused_or_foreach

from fleetlike.strategies.apply_groups import split_groups

__all__ = ["DEFAULT_COPIES", "UpdateTemporaries", "copies", "update_temporaries"]

#: copies of the largest parameter counted for an optimizer the rules below do not know
DEFAULT_COPIES = 2


@dataclasses.dataclass(frozen=True)
class UpdateTemporaries:
    """The update's peak temporaries on one rank and the rule that gave them."""

    bytes: int
    #: e.g. "AdamW single-tensor: 2 x the largest parameter (4.0 MiB)"
    rule: str


def copies(optimizer: torch.optim.Optimizer, group: dict) -> tuple[int, bool]:
    """(copies, known): how many temporaries of the stepped size one call of ``optimizer``'s
    update makes for ``group`` (one param group), per the module docstring."""
    name = type(optimizer).__name__
    wd = float(group.get("weight_decay", 0) or 0)
    if name in ("Adam", "AdamW"):
        coupled = name == "Adam" and not group.get("decoupled_weight_decay", False) and wd != 0
        if _implementation(group) == "foreach":
            return 1, True
        return 2 + int(coupled), True
    if name == "SGD":
        if _implementation(group) == "foreach":
            return int(wd != 0), True
        return int(wd != 0) + int(bool(group.get("nesterov", False))), True
    return DEFAULT_COPIES, False


def _implementation(group: dict, params: Sequence[torch.Tensor] = ()) -> str:
    if group.get("fused"):
        return "fused"
    foreach = group.get("foreach")
    if foreach is None:
        foreach = _default_to_fused_or_foreach(list(params or group["params"]), False, False)[1]
    return "foreach" if foreach else "single-tensor"


def update_temporaries(optimizer: torch.optim.Optimizer, stepped: Sequence[torch.Tensor] | None = None,
                       groups: int = 1, shards: int = 1) -> UpdateTemporaries:
    """The peak temporaries of one ``optimizer.step()`` over the parameters ``stepped`` (default:
    all of the optimizer's; stage 1 steps only its partition), its update run in ``groups`` calls
    (``num_apply_group``), each parameter held as one of ``shards`` equal dim-0 pieces (stages 2
    and 3 step their shards)."""
    chosen = {id(p) for p in stepped} if stepped is not None else None
    worst, rules = 0, []
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if chosen is None or id(p) in chosen]
        if not params:
            continue
        impl = _implementation(group, params)
        if impl == "fused":
            rules.append(f"{type(optimizer).__name__} fused: none")
            continue
        n, known = copies(optimizer, group)
        sizes = [-(-p.numel() // shards) * p.element_size() for p in params]
        if impl == "foreach":  # the groups are ApplyGroups', cut from the optimizer's order
            runs = split_groups(sizes, min(max(1, groups), len(sizes)))
            size, what = max(sum(sizes[i] for i in r) for r in runs), "the parameters one call steps"
        else:
            size, what = max(sizes), "the largest parameter"
        worst = max(worst, n * size)
        rules.append(f"{type(optimizer).__name__} {impl}: {n} x {what} ({size / 2**20:.1f} MiB)"
                     + ("" if known else " (an optimizer without a rule: counted as Adam's)"))
    return UpdateTemporaries(worst, "; ".join(rules) or "no parameters stepped")

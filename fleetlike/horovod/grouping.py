"""``groups=`` of ``hvd.DistributedOptimizer``: which gradients are reduced together.

Horovod's rule (``horovod/torch/optimizer.py``): an int ``n`` splits the trainable parameters, in
the optimizer's order, into ``n`` groups of nearly equal count (the first ``len % n`` one longer);
a list of lists of tensors makes each inner list one group, and every trainable parameter that
no list names a group of its own. A group's gradients are reduced as one fused operation once
all of them are ready; parameters without ``requires_grad`` are left out, as Horovod does.

Here each group is one gradient bucket (one flat buffer, one allreduce). A group that mixes
dtypes or devices becomes one bucket per dtype and device, next to each other (a flat buffer
holds one dtype). Buckets start in order, so the groups are ordered by when their last gradient
is expected: backward produces gradients roughly in reverse parameter order, so the group whose
first parameter comes latest goes first.

Example:
    >>> opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
    ...                                groups=[[model.fc1.weight, model.fc1.bias], [model.fc2.weight]])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["plan_groups"]

_KINDS = ("groups should be a non-negative integer or a list of list of torch.Tensor "
          "(hvd.DistributedOptimizer(groups=...)): an int n for n groups of parameters, or lists of "
          "parameters, each list reduced as one fused group")


def _split(items: list[Any], n: int) -> list[list[Any]]:
    """``items`` in ``n`` consecutive chunks of nearly equal length (the first ones longer)."""
    d, r = divmod(len(items), n)
    return [items[i * d + min(i, r):(i + 1) * d + min(i + 1, r)] for i in range(n)]


def _explicit(groups: list[Any], params: Sequence[torch.Tensor], names: dict[int, str]) -> list[list[torch.Tensor]]:
    position = {id(p): i for i, p in enumerate(params)}
    seen: set[int] = set()
    out: list[list[torch.Tensor]] = []
    for g, group in enumerate(groups):
        if isinstance(group, torch.Tensor) or not isinstance(group, (list, tuple)):
            raise ValueError(f"groups[{g}] is a {type(group).__name__}; {_KINDS}")
        kept = []
        for j, p in enumerate(group):
            if not isinstance(p, torch.Tensor):
                raise ValueError(f"groups must consist of torch.Tensor: groups[{g}][{j}] is a {type(p).__name__}")
            if id(p) in seen:
                raise ValueError(f"A parameter can only appear once in groups: groups[{g}][{j}] "
                                 f"({names.get(id(p), tuple(p.shape))}) is listed before")
            seen.add(id(p))
            if id(p) in position:
                kept.append(p)
            elif not p.requires_grad:
                continue  # a frozen parameter has no gradient to reduce (Horovod leaves it out too)
            else:
                raise ValueError(
                    f"groups[{g}][{j}] (a tensor of shape {tuple(p.shape)}) is not a parameter of the "
                    "wrapped optimizer, so no gradient of it is reduced; list only the optimizer's parameters")
        if kept:
            out.append(kept)
    out += [[p] for p in params if id(p) not in seen]
    return out


def _by_dtype(group: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    parts: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for p in group:
        parts.setdefault((p.dtype, p.device), []).append(p)
    return list(parts.values())


def plan_groups(groups: Any, params: Sequence[torch.Tensor], names: dict[int, str]) -> list[list[torch.Tensor]]:
    """The buckets (lists of ``params``, the trainable parameters in the optimizer's order) that
    ``groups`` asks for, in the order they start; raises ``ValueError`` naming a bad entry."""
    if isinstance(groups, list):
        chosen = _explicit(groups, params, names)
    elif isinstance(groups, int) and not isinstance(groups, bool) and groups > 0:
        chosen = [g for g in _split(list(params), groups) if g]
    else:
        raise ValueError(f"groups={groups!r}: {_KINDS}")
    position = {id(p): i for i, p in enumerate(params)}
    chosen.sort(key=lambda g: -min(position[id(p)] for p in g))
    return [part for g in chosen for part in _by_dtype(g)]

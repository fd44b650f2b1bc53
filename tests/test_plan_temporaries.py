"""The optimizer update's temporaries (`fleetlike.plan.temporaries`) against the RSS an
``optimizer.step()`` adds in this process (glibc's mmap threshold fixed at 128 KiB, so each
temporary is its own mapping, returned when freed): AdamW, Adam with coupled weight decay and
SGD with Nesterov momentum and weight decay, in their single-tensor and multi-tensor (foreach) implementations,
fused, and the multi-tensor update stepped in groups (``num_apply_group``)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from fleetlike.plan.temporaries import update_temporaries
from fleetlike.strategies.apply_groups import split_groups
from helpers import proc_status

#: the step's measured rise lies within this fraction of the predicted temporaries (plus a page
#: or two of allocator slack, `SLACK`)
TOLERANCE = 0.1
SLACK = 1 << 20
SIZES = [(1024, 1024), (1024, 512), (512,), (2048, 512)]


def _rise(opt: torch.optim.Optimizer, params: list[torch.Tensor], groups: int) -> int:
    """The RSS a second step adds above the level before it (the first makes the state)."""
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    chunks = [[params[i] for i in r] for r in split_groups([p.numel() for p in params], groups)]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = proc_status("VmRSS")
    for chunk in chunks:  # one call per group, the others' gradients hidden (ApplyGroups' way)
        held = {id(p): p.grad for p in params}
        for p in params:
            p.grad = held[id(p)] if any(p is q for q in chunk) else None
        opt.step()
        for p in params:
            p.grad = held[id(p)]
    return proc_status("VmHWM") - before


@pytest.mark.parametrize("name,kwargs,groups", [
    ("AdamW", {}, 1), ("AdamW", {"foreach": True}, 1), ("AdamW", {"foreach": True}, 2), ("AdamW", {"fused": True}, 1),
    ("Adam", {"weight_decay": 0.1}, 1), ("Adam", {"weight_decay": 0.1, "foreach": True}, 1),
    ("SGD", {"momentum": 0.9, "nesterov": True}, 1), ("SGD", {"momentum": 0.9, "nesterov": True, "foreach": True}, 1),
    ("SGD", {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1}, 1),
    ("SGD", {"momentum": 0.9, "weight_decay": 0.1, "foreach": True}, 1),
])
def test_predicted_update_temporaries_match_the_step(name, kwargs, groups):
    ctypes.CDLL("libc.so.6").mallopt(-3, 131072)  # M_MMAP_THRESHOLD
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s)) for s in SIZES]
    opt = getattr(torch.optim, name)(params, lr=1e-3, **kwargs)
    predicted = update_temporaries(opt, groups=groups)
    measured = _rise(opt, params, groups)
    print(f"{name} {kwargs} in {groups} group(s): measured {measured / 2**20:.2f} MiB, predicted "
          f"{predicted.bytes / 2**20:.2f} MiB ({predicted.rule})")
    assert abs(measured - predicted.bytes) <= TOLERANCE * predicted.bytes + SLACK, (measured, predicted)


def test_a_shard_or_a_partition_is_what_is_counted():
    params = [torch.nn.Parameter(torch.zeros(1024, 1024)), torch.nn.Parameter(torch.zeros(256, 1024))]
    opt = torch.optim.AdamW(params, lr=1e-3)
    assert update_temporaries(opt).bytes == 2 * 4 * 1024 * 1024
    assert update_temporaries(opt, shards=2).bytes == 2 * 4 * 512 * 1024
    assert update_temporaries(opt, stepped=params[1:]).bytes == 2 * 4 * 256 * 1024
    assert "single-tensor" in update_temporaries(opt).rule
    assert update_temporaries(torch.optim.Adagrad(params)).rule.endswith("(an optimizer without a rule: counted as Adam's)")

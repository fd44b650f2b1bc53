"""The optimizer update's temporaries (`fleetlike.plan.temporaries`) against the RSS an
``optimizer.step()`` adds in this process (glibc's mmap threshold fixed at 128 KiB, so each
temporary is its own mapping, returned when freed): AdamW, Adam with coupled weight decay and
SGD with Nesterov momentum and weight decay, in their single-tensor and multi-tensor (foreach) implementations,
fused, and the multi-tensor update stepped in groups (``num_apply_group``).

The steps are measured in a process of their own, started with the threshold already fixed: RSS
is the whole process's, and a long-lived test worker holds resident free heap left by earlier
tests (which a temporary can reuse without a new page) and threads of theirs that may free
memory while a step is measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


CASES = [
    ("AdamW", {}, 1), ("AdamW", {"foreach": True}, 1), ("AdamW", {"foreach": True}, 2), ("AdamW", {"fused": True}, 1),
    ("Adam", {"weight_decay": 0.1}, 1), ("Adam", {"weight_decay": 0.1, "foreach": True}, 1),
    ("SGD", {"momentum": 0.9, "nesterov": True}, 1), ("SGD", {"momentum": 0.9, "nesterov": True, "foreach": True}, 1),
    ("SGD", {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1}, 1),
    ("SGD", {"momentum": 0.9, "weight_decay": 0.1, "foreach": True}, 1),
]


def _measure_all() -> list[int]:
    """Each case's rise, in the order of `CASES` (run in a fresh process: see the module's doc)."""
    rises = []
    for name, kwargs, groups in CASES:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(*s)) for s in SIZES]
        rises.append(_rise(getattr(torch.optim, name)(params, lr=1e-3, **kwargs), params, groups))
        del params
    return rises


@pytest.fixture(scope="module")
def measured() -> list[int]:
    here = Path(__file__).resolve().parent
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072",
           "PYTHONPATH": os.pathsep.join([str(here), str(here.parent), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{n}-{'-'.join(k) or 'default'}-{g}" for n, k, g in CASES])
def test_predicted_update_temporaries_match_the_step(case, measured):
    name, kwargs, groups = CASES[case]
    params = [torch.nn.Parameter(torch.zeros(*s)) for s in SIZES]
    predicted = update_temporaries(getattr(torch.optim, name)(params, lr=1e-3, **kwargs), groups=groups)
    rise = measured[case]
    print(f"{name} {kwargs} in {groups} group(s): measured {rise / 2**20:.2f} MiB, predicted "
          f"{predicted.bytes / 2**20:.2f} MiB ({predicted.rule})")
    assert abs(rise - predicted.bytes) <= TOLERANCE * predicted.bytes + SLACK, (rise, predicted)


def test_a_shard_or_a_partition_is_what_is_counted():
    params = [torch.nn.Parameter(torch.zeros(1024, 1024)), torch.nn.Parameter(torch.zeros(256, 1024))]
    opt = torch.optim.AdamW(params, lr=1e-3)
    assert update_temporaries(opt).bytes == 2 * 4 * 1024 * 1024
    assert update_temporaries(opt, shards=2).bytes == 2 * 4 * 512 * 1024
    assert update_temporaries(opt, stepped=params[1:]).bytes == 2 * 4 * 256 * 1024
    assert "single-tensor" in update_temporaries(opt).rule
    assert update_temporaries(torch.optim.Adagrad(params)).rule.endswith("(an optimizer without a rule: counted as Adam's)")


if __name__ == "__main__":
    print(json.dumps(_measure_all()))

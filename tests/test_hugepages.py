"""Fresh per-step buffers in transparent huge pages (`fleetlike.collectives.hugepages`): the
tensor is a working buffer aligned to a huge page, the kernel backs it with huge pages where it
grants them on request, the mapping is gone (the memory back with the system) once its last view
is freed, and a buffer glibc can recycle (below 32 MiB) is plain ``torch.empty``. On 2 real gloo
ranks, stage 2 with the default 32 MB buckets takes this path and trains bit for bit as stage 1."""

from __future__ import annotations

import re

import pytest
import torch

from fleetlike import DistributedStrategy, fleet
from fleetlike.collectives import TransientBucket
from fleetlike.collectives.hugepages import GLIBC_ALWAYS_MAPS, HUGE_PAGE, empty_transient, huge_pages_granted
from fleetlike.testing import run_ranks

CPU = torch.device("cpu")


def _mapping_of(ptr: int) -> dict[str, int] | None:
    """The /proc/self/smaps entry holding address ``ptr``: its size and huge-page bytes, in KiB."""
    entries = re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", open("/proc/self/smaps").read())
    for entry in entries:
        lo, hi = (int(x, 16) for x in entry.split(" ", 1)[0].split("-"))
        if lo <= ptr < hi:
            fields = dict(re.findall(r"^(\w+):\s+(\d+) kB", entry, re.M))
            return {"size": int(fields["Size"]), "huge": int(fields["AnonHugePages"])}
    return None


def test_a_large_buffer_is_its_own_huge_page_mapping_freed_with_its_last_view():
    numel = GLIBC_ALWAYS_MAPS // 4 + 5  # not a whole number of huge pages
    buf = empty_transient(numel, torch.float32, CPU)
    assert buf.shape == (numel,) and buf.dtype == torch.float32 and buf.is_contiguous()
    assert buf.data_ptr() % HUGE_PAGE == 0
    buf.copy_(torch.arange(numel, dtype=torch.float32))
    assert torch.equal(buf[-3:], torch.arange(numel - 3, numel, dtype=torch.float32))
    ptr = buf.data_ptr()
    mapping = _mapping_of(ptr)
    page = 4096
    assert mapping is not None and mapping["size"] * 1024 == -(-(numel * 4 + HUGE_PAGE) // page) * page
    if huge_pages_granted():  # the kernel's setting: always or madvise on every machine the suite runs on
        assert mapping["huge"] * 1024 >= GLIBC_ALWAYS_MAPS, mapping
    view = buf[7:9]
    del buf
    assert _mapping_of(ptr) is not None  # a view keeps the mapping
    del view
    assert _mapping_of(ptr) is None  # the last view gone: unmapped, the memory back with the system


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64, torch.int32])
def test_other_dtypes_keep_their_element_count(dtype):
    numel = GLIBC_ALWAYS_MAPS // dtype.itemsize + 3
    buf = empty_transient(numel, dtype, CPU)
    assert buf.numel() == numel and buf.dtype == dtype and buf.data_ptr() % HUGE_PAGE == 0
    buf.fill_(3)
    assert int(buf.sum().item()) == 3 * numel if dtype != torch.bfloat16 else buf[-1].item() == 3


def test_a_buffer_glibc_can_recycle_is_a_plain_allocation():
    numel = GLIBC_ALWAYS_MAPS // 4 - 1
    buf = empty_transient(numel, torch.float32, CPU)
    assert buf.numel() == numel
    mapping = _mapping_of(buf.data_ptr())
    # glibc's block, not a mapping of exactly this buffer's size plus one huge page
    assert mapping is None or mapping["size"] * 1024 != numel * 4 + HUGE_PAGE


WIDTH = 1024  # a Linear(1024, 1024) weight is 4 MiB: the first default (32 MB) bucket holds 8 of them


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    layers: list[torch.nn.Module] = []
    for _ in range(8):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 8))


def _train(role, stage: int) -> dict:
    opts = {"sharding": True,
            "sharding_configs": {"sharding_degree": 0, "stage": stage}}
    model = fleet.distributed_model(_model())
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                      DistributedStrategy.from_dict(opts))
    reducer = model.engine.ctx.reducer
    seen: list[tuple[int, bool]] = []

    def note(_: torch.Tensor) -> None:
        for b in reducer.buckets:
            if isinstance(b, TransientBucket) and b.live and not b.resident and not b.adopts:
                seen.append((b.nbytes, len(b.params), b.buffer.data_ptr() % HUGE_PAGE == 0))

    hooks = [p.register_post_accumulate_grad_hook(note) for p in model.parameters()]
    g = torch.Generator().manual_seed(11 + role.rank)
    for _ in range(2):
        x, y = torch.randn(4, WIDTH, generator=g), torch.randint(0, 8, (4,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    for h in hooks:
        h.remove()
    return {"state": {k: v.clone() for k, v in fleet.full_state_dict(model).items()}, "seen": seen}


def _ranks(role) -> dict:
    with fleet.session(role, timeout=60):
        return {stage: _train(role, stage) for stage in (1, 2)}


@pytest.mark.timeout(120)
def test_stage2_with_huge_page_buckets_trains_bitwise_as_stage1():
    for res in run_ranks(_ranks, 2, timeout=100):
        one, two = res[1]["state"], res[2]["state"]
        assert one.keys() == two.keys()
        assert all(torch.equal(one[k], two[k]) for k in one)
        # a bucket of one parameter takes autograd's own gradient as its buffer: not counted
        large = [aligned for nbytes, params, aligned in res[2]["seen"] if nbytes >= GLIBC_ALWAYS_MAPS and params > 1]
        assert large and all(large), sorted(set(res[2]["seen"]))

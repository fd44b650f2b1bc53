"""Fresh per-step buffers in transparent huge pages (`fleetlike.collectives.hugepages`): the
tensor is a working buffer aligned to a huge page, the kernel backs it with huge pages where it
grants them on request, the mapping is gone (the memory back with the system) once its last view
is freed, and a buffer glibc can recycle (below 32 MiB) is plain ``torch.empty``. On 2 real gloo
ranks, stage 2 with the default 32 MB buckets takes this path and trains bit for bit as stage 1,
in a plain loop and in the program style."""

from __future__ import annotations

import re
from unittest import mock

import pytest
import torch

from fleetlike import DistributedStrategy, Executor, fleet
from fleetlike.collectives import transient
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


def _feed(step: int, rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11 + 100 * step + rank)
    return {"x": torch.randn(4, WIDTH, generator=g), "y": torch.randint(0, 8, (4,), generator=g)}


def _loss(model: torch.nn.Module, feed: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(feed["x"]), feed["y"])


def _train(role, stage: int, style: str) -> dict:
    """Two steps in ``style`` (a plain loop, or ``minimize`` + ``Executor``); every transient
    bucket buffer stage 2 made: its bytes and whether it is a huge-page-aligned mapping."""
    opts = DistributedStrategy.from_dict({"sharding": True,
                                          "sharding_configs": {"sharding_degree": 0, "stage": stage}})
    made: list[tuple[int, bool]] = []

    def spy(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = empty_transient(numel, dtype, device)
        made.append((numel * dtype.itemsize, buf.data_ptr() % HUGE_PAGE == 0))
        return buf

    with mock.patch.object(transient, "empty_transient", spy):
        model = _model()
        if style == "eager":
            wrapped = fleet.distributed_model(model)
            opt = fleet.distributed_optimizer(torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9), opts)
            for step in range(2):
                opt.zero_grad()
                _loss(wrapped, _feed(step, role.rank)).backward()
                opt.step()
            full = fleet.full_state_dict(wrapped)
        else:
            opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), opts)
            opt.minimize(_loss, model)
            exe = Executor()
            exe.run(fleet.startup_program)
            for step in range(2):
                exe.run(fleet.main_program, feed=_feed(step, role.rank))
            full = fleet.full_state_dict(model)
    return {"state": {k: v.clone() for k, v in full.items()}, "made": made}


def _ranks(role) -> dict:
    with fleet.session(role, timeout=60):
        return {(style, stage): _train(role, stage, style) for style in ("eager", "program") for stage in (1, 2)}


@pytest.mark.timeout(120)
def test_stage2_with_huge_page_buckets_trains_bitwise_as_stage1():
    for res in run_ranks(_ranks, 2, timeout=100):
        for style in ("eager", "program"):
            one, two = res[(style, 1)]["state"], res[(style, 2)]["state"]
            assert one.keys() == two.keys()
            assert all(torch.equal(one[k], two[k]) for k in one), style
            assert not res[(style, 1)]["made"], style  # stage 1's buckets are resident
            large = [aligned for nbytes, aligned in res[(style, 2)]["made"] if nbytes >= GLIBC_ALWAYS_MAPS]
            assert large and all(large), (style, res[(style, 2)]["made"])

"""Buffers made fresh every step, in transparent huge pages where the kernel grants them.

A stage 2 gradient bucket (`fleetlike.collectives.transient`) is allocated at its first gradient
and dropped once reduced, every step. glibc serves a block of `GLIBC_ALWAYS_MAPS` (32 MiB) or
more from a mapping of its own, made on allocation and unmapped on free: its dynamic mmap
threshold, which rises to let smaller freed blocks be recycled from the heap, stops there
(``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit). So such a bucket (the default
``fuse_grad_size_in_MB`` is 32) is fresh memory every step, and the gradients copied into it
fault its pages in 4 KiB at a time: at 8.4M parameters on 2 gloo ranks stage 2's backward took
61 ms against stage 1's 42-50, 8193 minor faults a backward; in huge pages 47-48 ms, 16 faults.
Filling a fresh 32 MiB buffer on one thread: 15.3 ms in 4 KiB pages, 5.5 in huge pages, 2.9 for
memory already mapped (`bench/hugepages.py`). Keeping the buffers from step to step would save the faults too
but hold the memory stage 2 exists to give back; huge pages keep it transient. A smaller block
stays ``torch.empty``: glibc usually recycles it from its heap without a fault, which a mapping
of its own would forgo (the kernel zeroes every fresh huge page: at 25 MB buckets, which glibc
recycles, huge pages made the same backward 2-5 ms slower).

`empty_transient` maps a private anonymous region with ``MADV_HUGEPAGE`` (the kernel's
``transparent_hugepage/enabled`` set to ``madvise`` grants huge pages only on that request,
``always`` grants them anyway, ``never`` refuses and the region falls back to 4 KiB pages), and
unmaps it when the last tensor viewing it is freed: the memory goes back to the system exactly as
glibc's large blocks do. torch's own ``THP_MEM_ALLOC_ENABLE`` does the same for every CPU
allocation of 2 MiB or more, process-wide and read once at start-up; this asks for the transient
buffers only. Elsewhere (other devices, blocks below `GLIBC_ALWAYS_MAPS`, no ``madvise`` on the
platform) it is ``torch.empty``.

Example:
    >>> buf = empty_transient(8 << 20, torch.float32, torch.device("cpu"))
    >>> buf.copy_(grads)   # 16 faults of 2 MiB where the kernel grants them, not 8192 of 4 KiB
"""

from __future__ import annotations

import mmap

import torch

__all__ = ["GLIBC_ALWAYS_MAPS", "HUGE_PAGE", "empty_transient", "huge_pages_granted"]

#: the x86-64 and arm64 (4 KiB base page) transparent huge page
HUGE_PAGE = 2 << 20
#: glibc's dynamic mmap threshold never rises above this on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX``,
#: ``4 * 1024 * 1024 * sizeof(long)``): a block this large is a fresh mapping on every allocation
GLIBC_ALWAYS_MAPS = 32 << 20
_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)
_FLAGS = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)


def huge_pages_granted() -> bool:
    """Whether the kernel grants transparent huge pages to a region that asks (its
    ``enabled`` setting is ``always`` or ``madvise``); False where it cannot be read."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            setting = f.read()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting


def empty_transient(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised 1-D tensor of ``numel`` elements for a buffer made and dropped every
    step: on the CPU, at `GLIBC_ALWAYS_MAPS` or more where ``madvise`` exists, in its own mapping
    advised for huge pages and aligned to one (module docstring); otherwise ``torch.empty``."""
    nbytes = numel * dtype.itemsize
    if device.type != "cpu" or nbytes < GLIBC_ALWAYS_MAPS or _ADVICE is None or not _FLAGS:
        return torch.empty(numel, dtype=dtype, device=device)
    # one huge page more than asked: the kernel places an anonymous mapping on a 4 KiB boundary,
    # and only the 2 MiB-aligned stretches of it can be huge pages; the slack before the aligned
    # start is never touched, so it costs address space, not memory
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=_FLAGS)
    try:
        region.madvise(_ADVICE)
    except OSError:  # a kernel built without transparent huge pages: EINVAL, the 4 KiB pages stay
        pass
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping until the last view goes
    start = -raw.data_ptr() % HUGE_PAGE
    # one byte written per huge page, from this thread: the pages are faulted in here, one by
    # one. Left to the first copy, torch's intra-op threads fault the same huge pages at once
    # and wait on each other: a 4 MiB copy on 2 threads took 4.6 ms into a fresh mapping, 0.16
    # after this touch (0.19 on one thread without it)
    raw[start : start + nbytes : HUGE_PAGE].zero_()
    return raw[start : start + nbytes].view(dtype)

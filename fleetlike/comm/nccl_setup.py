"""Whether the `nccl` backend can run here, on which GPU, and how NCCL's unique id travels.

Why a module of its own: these answers are needed before any communicator exists (and by
code that only picks a backend: `nccl_unavailable_reason`), and they are what differs between
machines and CuPy versions: CUDA, CuPy and its NCCL library are checked in that order, each
missing piece named with its fix (`NcclUnavailableError.reason`); the rank's GPU is chosen
from ``device``, ``selected_gpus`` or the local rank; the 128-byte unique id is stored as raw
bytes and handed back to CuPy in whichever form its binding takes. CuPy is imported lazily, so
this module imports on a machine without a GPU.

Example:
    >>> backend = "nccl" if nccl_unavailable_reason() is None else "gloo"
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import torch

from fleetlike.comm.cuda import selected_gpu
from fleetlike.comm.errors import CommError
from fleetlike.roles.role import Role

__all__ = [
    "NCCL_2_10",
    "NCCL_AVG",
    "NCCL_BFLOAT16",
    "UID_BYTES",
    "NcclUnavailableError",
    "nccl_unavailable_reason",
    "require_nccl",
    "resolve_device",
    "uid_candidates",
    "uid_to_bytes",
]

#: NCCL's runtime version code from which ncclAvg and ncclBfloat16 exist (2.10.0).
NCCL_2_10 = 21000
#: NCCL's enum values, fixed by its ABI (used where an old binding lacks the constant).
NCCL_AVG = 4
NCCL_BFLOAT16 = 9
UID_BYTES = 128
_GPU_EXTRA = "pip install 'fleetlike[gpu]'"


class NcclUnavailableError(CommError):
    """The `nccl` backend cannot run here. ``reason`` says which check failed.

    Reasons: ``"no_cuda"`` (torch sees no CUDA device), ``"no_cupy"`` (CuPy does not import),
    ``"no_nccl"`` (CuPy has no NCCL library), ``"no_device"`` (the chosen GPU does not exist).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


_NCCL: Any = None  # CuPy's nccl module once it loaded


def require_nccl() -> Any:
    """CuPy's NCCL module, after checking CUDA, CuPy and NCCL in that order."""
    global _NCCL
    if not torch.cuda.is_available():
        build = (
            f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA (a CPU-only build)"
        )
        raise NcclUnavailableError(
            "no_cuda",
            f"backend='nccl' moves CUDA tensors, but torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}, built with {build}). Use backend='gloo' (or 'auto') for "
            "CPU tensors. On a GPU machine, check the driver with `nvidia-smi`, that "
            "CUDA_VISIBLE_DEVICES is not empty, and that torch is a CUDA build.",
        )
    if _NCCL is not None:
        return _NCCL
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - ImportError, or a CUDA library CuPy cannot load
        raise NcclUnavailableError(
            "no_cupy",
            f"backend='nccl' needs CuPy for its NCCL binding, but `import cupy` failed: {exc}. "
            f"Install it with `{_GPU_EXTRA}` (cupy-cuda12x and nvidia-nccl-cu12; for a CUDA 13 "
            f"torch, cupy-cuda13x and nvidia-nccl-cu13; this torch has CUDA {torch.version.cuda}), "
            "or use backend='gloo' for CPU tensors.",
        ) from exc
    try:
        from cupy.cuda import nccl
    except Exception as exc:  # noqa: BLE001
        nccl, error = None, exc
    else:
        error = None
    if nccl is None or not getattr(nccl, "available", False):
        detail = f": {error}" if error is not None else ""
        version = getattr(cupy, "__version__", "?")
        raise NcclUnavailableError(
            "no_nccl",
            f"CuPy {version} imports, but its NCCL binding (cupy.cuda.nccl) is not available: "
            f"the NCCL library was not found{detail}. Install it with `pip install "
            f"nvidia-nccl-cu12` (nvidia-nccl-cu13 for CUDA 13; `{_GPU_EXTRA}` brings it) or a "
            "system NCCL, check the driver with `nvidia-smi`, and test with "
            "`python -c \"from cupy.cuda import nccl; print(nccl.get_version())\"`.",
        ) from error
    _NCCL = nccl
    return nccl


def nccl_unavailable_reason() -> str | None:
    """None when the `nccl` backend can run here, else the message saying why not.

    Example:
        >>> backend = "nccl" if nccl_unavailable_reason() is None else "gloo"
    """
    try:
        require_nccl()
    except NcclUnavailableError as exc:
        return str(exc)
    return None


def resolve_device(role: Role, device: torch.device | str | int | None) -> torch.device:
    """The GPU of this rank: ``device``, else ``role.selected_gpus``, else the local rank."""
    count = torch.cuda.device_count()
    if device is not None:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if dev.type != "cuda":
            raise ValueError(
                f"device={device!r}: the 'nccl' backend runs on a CUDA device; pass one such as "
                "'cuda:0', or use backend='gloo' for CPU tensors"
            )
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        source = f"device={device!r}"
    elif role.selected_gpus:
        index = selected_gpu(role.selected_gpus, role.local_rank, role.rank)
        source = f"selected_gpus={list(role.selected_gpus)} (FLAGS_selected_gpus)"
    else:
        index = role.local_rank
        source = f"local_rank={role.local_rank}"
    if not 0 <= index < count:
        raise NcclUnavailableError(
            "no_device",
            f"rank {role.rank}: GPU {index} (from {source}) does not exist; this process sees "
            f"{count} CUDA device(s). Start at most {count} process(es) per node, or pick GPU ids "
            f"below {count} with --selected_gpus; `nvidia-smi -L` lists the GPUs.",
        )
    return torch.device("cuda", index)


def uid_to_bytes(uid: bytes | Sequence[int]) -> bytes:
    """NCCL's unique id as its raw bytes.

    CuPy 14 gives the 128 bytes as ``bytes``; older CuPy gave a tuple of 128 C ``char`` values
    (signed on x86, unsigned on Arm). Both land in the store as the same raw bytes.
    """
    if isinstance(uid, (bytes, bytearray)):
        return bytes(uid)
    return bytes(v & 0xFF for v in uid)


def uid_candidates(raw: bytes) -> list[bytes | tuple[int, ...]]:
    """The id in each form a CuPy binding may take back, the newest first.

    ``bytes`` (CuPy >= 14), then signed chars (older CuPy on x86), then unsigned chars (Arm).
    A binding refuses the wrong form with ``TypeError`` (bytes vs tuple) or ``OverflowError``
    (char signedness), so the caller tries them in turn.
    """
    return [bytes(raw), struct.unpack(f"{len(raw)}b", raw), tuple(raw)]

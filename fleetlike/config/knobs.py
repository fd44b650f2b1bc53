"""Environment knobs: ``FLEETLIKE_*``, AIACC's ``PERSEUS_*`` and TI-ACC's ``TIACC_*`` / ``LIGHT_*``
variables, each one set of `DistributedStrategy` options, or refused with the reason.

One table and one function (`knob_options`) that every face reads through
`fleetlike.roles.settings.strategy_with_env`: Fleet's (``fleet.distributed_model`` /
``distributed_optimizer``, program and eager style), Horovod's (``hvd.DistributedOptimizer``
takes fleet's effective strategy) and DDP's (`fleetlike.auto`). The knobs are applied over
``FLEETLIKE_STRATEGY`` (JSON text or a file), which is applied over the script's strategy: the
environment has the last word, in every face alike.

A vendor's variable acts with its documented meaning, units and range where fleetlike has the
feature (``PERSEUS_ALLREDUCE_FUSION=16`` = buckets of 1/16 of the gradients, at most 16;
``TIACC_TRAINING_FUSION_THRESHOLD`` in bytes), and is refused with the reason and the
fleetlike equivalent where it has not. Another name with one of the four prefixes that is one
slip away from a known one (``..._ALLREDUCE_STREMS``) is a `KnobError` naming it: a
misspelt knob never silently does nothing. Any other such name (a script's own
variable under the prefix, a vendor variable of a feature fleetlike has no table row for) is warned
about once and left alone, as torch and Horovod leave names of their families they do not read.

This module reads no environment itself: callers pass the mapping.

Example:
    >>> knob_options({"PERSEUS_ALLREDUCE_STREAMS": "4", "LIGHT_2D_ALLREDUCE": "1"})
    {'use_hierarchical_allreduce': True, 'nccl_comm_num': 4}
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from fleetlike.config import envvars

__all__ = [
    "KNOBS", "KNOWN_ELSEWHERE", "PREFIXES", "TYPO_RATIO", "VENDOR_KNOBS", "Knob", "KnobError", "VendorKnob", "applied_knobs",
    "apply_knobs", "knob_options", "vendor_names",
]

#: the variable families fleetlike owns or reads: an unknown name with one of them is refused
#: when it is a near miss of a known name, and warned about otherwise
PREFIXES = ("FLEETLIKE_", "PERSEUS_", "TIACC_", "LIGHT_")

#: ``FLEETLIKE_*`` variables other parts of fleetlike (and its launcher) read: not knobs, not
#: errors (the table of `fleetlike.config.envvars`, less the knobs)
KNOWN_ELSEWHERE = envvars.fleetlike_names() - frozenset(envvars.KNOB_NAMES)


class KnobError(ValueError):
    """A knob variable that is unknown, refused, or holds a value it does not accept."""


Options = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Knob:
    """One ``FLEETLIKE_*`` knob: its values and the strategy options a value sets."""

    name: str
    accepted: str
    aiacc: str
    parse: Callable[[str], Options]


@dataclasses.dataclass(frozen=True)
class VendorKnob:
    """A vendor's variable: ``parse`` turns a value into strategy options (raising
    ValueError/KeyError for a value outside ``accepted``), or ``refused`` says why fleetlike
    cannot honour it and what to use instead. ``equivalent`` is fleetlike's name for it."""

    name: str
    accepted: str
    equivalent: str
    parse: Callable[[str], Options] | None = None
    refused: str | None = None


def _choice(options: Mapping[str, Options]) -> Callable[[str], Options]:
    def parse(text: str) -> Options:
        return dict(options[text.strip().lower()])  # KeyError -> KnobError
    return parse


def _int(lo: int, hi: int | None, build: Callable[[int], Options]) -> Callable[[str], Options]:
    def parse(text: str) -> Options:
        value = int(text.strip())
        if value < lo or (hi is not None and value > hi):
            raise ValueError(text)
        return build(value)
    return parse


def _positive(build: Callable[[float], Options]) -> Callable[[str], Options]:
    def parse(text: str) -> Options:
        value = float(text.strip())
        if not value > 0 or not math.isfinite(value):
            raise ValueError(text)
        return build(value)
    return parse


def _only(value: str) -> Callable[[str], Options]:
    """A variable whose only value fleetlike honours is ``value`` (what it always does)."""
    def parse(text: str) -> Options:
        if text.strip() != value:
            raise ValueError(text)
        return {}
    return parse


_F16 = "fp16_allreduce_configs"
_DTYPES = {
    "fp32": {"fp16_allreduce": False},
    "fp16": {"fp16_allreduce": True, f"{_F16}.dtype": "float16", f"{_F16}.mode": "all"},
    "bf16": {"fp16_allreduce": True, f"{_F16}.dtype": "bfloat16", f"{_F16}.mode": "all"},
    "mixed": {"fp16_allreduce": True, f"{_F16}.dtype": "float16", f"{_F16}.mode": "mixed"},
}
_MODES = {"flat": {"use_hierarchical_allreduce": False}, "hierarchical": {"use_hierarchical_allreduce": True},
          "auto": {"use_hierarchical_allreduce": True}}


def _accumulate(v: int) -> Options:
    return {"gradient_merge": v > 1, "gradient_merge_configs.k_steps": v}


def _perf(v: int) -> Options:
    return {"slow_rank_check": v > 0, "slow_rank_check_configs.every_n_steps": max(v, 1)}


def _gossip(v: int) -> Options:
    return {"gossip": v > 1, "gossip_configs.downsample_n_elements": max(v, 2)}


def _fraction(v: int) -> Options:
    """AIACC's fusion granularity: buckets of 1/v of all gradients (0: fleetlike's own size)."""
    if v == 0:
        return {}
    return {"fuse_all_reduce_ops": True, "fuse_grad_size_in_MB": 1 / (1 << 20), "fuse_grad_max_buckets": v}


KNOBS: tuple[Knob, ...] = (
    Knob(envvars.ALLREDUCE_DTYPE, "fp32, fp16, bf16, mixed", "PERSEUS_ALLREDUCE_DTYPE", _choice(_DTYPES)),
    Knob(envvars.ALLREDUCE_MODE, "flat, hierarchical, auto", "PERSEUS_ALLREDUCE_MODE", _choice(_MODES)),
    Knob(envvars.ALLREDUCE_STREAMS, "an integer from 1 to 16", "PERSEUS_ALLREDUCE_STREAMS",
         _int(1, 16, lambda v: {"nccl_comm_num": v})),
    Knob(envvars.FUSION_MB, "a number of MB > 0", "PERSEUS_ALLREDUCE_FUSION",
         _positive(lambda v: {"fuse_all_reduce_ops": True, "fuse_grad_size_in_MB": v})),
    Knob(envvars.GRADIENT_SCALE, "a number > 0 (with a 16-bit FLEETLIKE_ALLREDUCE_DTYPE)",
         "PERSEUS_ALLREDUCE_GRADIENT_SCALE", _positive(lambda v: {f"{_F16}.grad_scale": v})),
    Knob(envvars.ACCUMULATE_N_STEPS, "an integer >= 1", "PERSEUS_ACCUMULATE_N_STEPS", _int(1, None, _accumulate)),
    Knob(envvars.NAN_CHECK, "0 or 1", "PERSEUS_ALLREDUCE_NANHECK",
         _choice({"0": {"check_nan_inf": False}, "1": {"check_nan_inf": True}})),
    Knob(envvars.PERF_CHECK_N_STEPS, "an integer >= 0 (0 = off)", "PERSEUS_PERF_CHECK_N_STEPS", _int(0, None, _perf)),
    Knob(envvars.DOWNSAMPLE_N_ELEMENTS, "an integer >= 1 (1 = off)", "PERSEUS_DOWNSAMPLE_N_ELEMENTS",
         _int(1, None, _gossip)),
)
_BY_NAME = {k.name: k for k in KNOBS}

#: AIACC's appendix (seed 004) and TI-ACC's mpirun line (seed 001), in their documents' order
VENDOR_KNOBS: tuple[VendorKnob, ...] = (
    VendorKnob("PERSEUS_ALLREDUCE_NANHECK", "0 or 1", "FLEETLIKE_NAN_CHECK / check_nan_inf",
               _choice({"0": {"check_nan_inf": False}, "1": {"check_nan_inf": True}})),
    VendorKnob("PERSEUS_ALLREDUCE_DTYPE", "0 (fp16 wire), 1 (fp32), 2 (fp32 in a node, fp16 across)",
               "FLEETLIKE_ALLREDUCE_DTYPE / fp16_allreduce",
               _choice({"0": _DTYPES["fp16"], "1": _DTYPES["fp32"], "2": _DTYPES["mixed"]})),
    VendorKnob("PERSEUS_ALLREDUCE_MODE", "0 (one-level) or 1 (two-level by node)",
               "FLEETLIKE_ALLREDUCE_MODE / use_hierarchical_allreduce",
               _choice({"0": _MODES["flat"], "1": _MODES["hierarchical"]})),
    VendorKnob("PERSEUS_ALLREDUCE_STREAMS", "an integer from 1 to 12", "FLEETLIKE_ALLREDUCE_STREAMS / nccl_comm_num",
               _int(1, 12, lambda v: {"nccl_comm_num": v})),
    VendorKnob("PERSEUS_ALLREDUCE_FUSION", "an integer from 0 to 128: buckets of 1/N of all gradients (0 = automatic)",
               "fuse_grad_max_buckets (FLEETLIKE_FUSION_MB for a size in MB)", _int(0, 128, _fraction)),
    VendorKnob("PERSEUS_ACCUMULATE_N_STEPS", "an integer >= 1", "FLEETLIKE_ACCUMULATE_N_STEPS / gradient_merge",
               _int(1, None, _accumulate)),
    VendorKnob("PERSEUS_DOWNSAMPLE_N_ELEMENTS", "an integer >= 1 (1 = off)", "FLEETLIKE_DOWNSAMPLE_N_ELEMENTS / gossip",
               _int(1, None, _gossip)),
    VendorKnob("PERSEUS_GRADIENT_MOMENTUM", "1", "gossip's residual (kept whole)", _only("1"),
               "fleetlike's gossip keeps the unsent part of each gradient whole as its residual (AIACC's default "
               "momentum 1); a decayed residual is not implemented: use 1, or leave it unset"),
    VendorKnob("PERSEUS_NCCL_ENABLE", "0", "none", _only("0"),
               "AIACC's NCCL over RDMA and VPC links at once is a special build; fleetlike's NCCL communicators "
               "use the links NCCL picks (NCCL_* variables): use 0, or leave it unset"),
    VendorKnob("PERSEUS_ALLREDUCE_GRADIENT_SCALE", "a number > 0 (with PERSEUS_ALLREDUCE_DTYPE 0 or 2)",
               "FLEETLIKE_GRADIENT_SCALE / fp16_allreduce_configs.grad_scale",
               _positive(lambda v: {f"{_F16}.grad_scale": v})),
    VendorKnob("PERSEUS_OFFLINE_NEG", "0", "none (buckets are planned once)", _only("0"),
               "fleetlike plans the gradient buckets once, when the model or optimizer is wrapped, and never "
               "negotiates them per step, so there is nothing to move offline: use 0, or leave it unset"),
    VendorKnob("PERSEUS_PERF_CHECK_N_STEPS", "an integer >= 0 (0 = off)",
               "FLEETLIKE_PERF_CHECK_N_STEPS / slow_rank_check", _int(0, None, _perf)),
    VendorKnob("PERSEUS_MASTER_PORT", "", "FLEETLIKE_MASTER_PORT / --started_port",
               refused="AIACC starts a second rendezvous service beside torch's on this port; fleetlike has one "
                       "rendezvous, on the launcher's ports: set --started_port (or FLEETLIKE_MASTER_PORT) instead"),
    VendorKnob("PERSEUS_NCCL_NETWORK_INTERFACE", "", "NCCL_SOCKET_IFNAME",
               refused="NCCL reads its interface from NCCL_SOCKET_IFNAME; set that instead (e.g. NCCL_SOCKET_IFNAME=eth0)"),
    VendorKnob("PERSEUS_GLOO_NETWORK_INTERFACE", "", "FLEETLIKE_NODE_IP / --ips",
               refused="fleetlike's gloo communicator connects to the addresses of the job's endpoints; choose the "
                       "interface by its address with --ips / --cluster_node_ips (FLEETLIKE_NODE_IP)"),
    VendorKnob("PERSEUS_CHANGE_HVD_ALLGATHER", "1", "hvd.allgather / torch.distributed.all_gather", _only("1"),
               "fleetlike's hvd.allgather concatenates along the first dimension (AIACC's 1) and "
               "torch.distributed.all_gather fills a list (DDP's form); each call keeps its framework's form: use 1, "
               "or torch.stack the list of torch's all_gather for AIACC's 0"),
    VendorKnob("PERSEUS_USE_DDP_LAUNCHER", "0 or 1", "none (the launch is detected)", _choice({"0": {}, "1": {}}),
               None),
    VendorKnob("PERSEUS_LIBRARY_PATH", "", "none", refused=(
        "a build setting of AIACC's Caffe support (-DPERSEUS_LIBRARY_PATH); fleetlike is PyTorch only: unset it")),
    VendorKnob("LIGHT_2D_ALLREDUCE", "0 or 1", "FLEETLIKE_ALLREDUCE_MODE / use_hierarchical_allreduce",
               _choice({"0": _MODES["flat"], "1": _MODES["hierarchical"]})),
    VendorKnob("TIACC_TRAINING_FUSION_THRESHOLD", "a number of bytes > 0", "FLEETLIKE_FUSION_MB / fuse_grad_size_in_MB",
               _positive(lambda v: {"fuse_all_reduce_ops": True, "fuse_grad_size_in_MB": v / (1 << 20)})),
    VendorKnob("TIACC_TRAINING_NUM_NCCL_STREAMS", "an integer from 1 to 16",
               "FLEETLIKE_ALLREDUCE_STREAMS / nccl_comm_num", _int(1, 16, lambda v: {"nccl_comm_num": v})),
)
_VENDOR = {k.name: k for k in VENDOR_KNOBS}


def vendor_names() -> tuple[str, ...]:
    """Every vendor variable the table knows, in its order."""
    return tuple(_VENDOR)


#: how alike (difflib's ratio) an unknown name and a known one are when the unknown one is taken
#: for a typo of it: one dropped, doubled or swapped letter in these names scores above 0.9,
#: while two different words after a shared prefix (..._TEST_HOST beside
#: ..._TEST_MARKER) stay near 0.75
TYPO_RATIO = 0.9
_WARNED: set[str] = set()


def _known_names() -> list[str]:
    return [k.name for k in KNOBS] + list(_VENDOR) + sorted(KNOWN_ELSEWHERE)


def _misspelt(name: str, value: str, near: str) -> KnobError:
    return KnobError(f"{name}={value!r} is not a fleetlike setting; did you mean {near}? the knobs are "
                     f"{', '.join(k.name for k in KNOBS)}, AIACC's and TI-ACC's {', '.join(_VENDOR)} (fleetlike also "
                     f"reads {', '.join(sorted(KNOWN_ELSEWHERE))}). Fix the name or unset it")


def applied_knobs(environ: Mapping[str, str]) -> dict[str, str]:
    """The knobs (``FLEETLIKE_*`` and vendor) set in ``environ``, by name; `KnobError` for an
    unknown name with one of the `PREFIXES` that is a near miss of a known one (`TYPO_RATIO`);
    a `UserWarning`, once per name and process, for any other unknown name, which is ignored."""
    found = {}
    for name, value in sorted(environ.items()):
        if not name.startswith(PREFIXES) or name in KNOWN_ELSEWHERE:
            continue
        if name not in _BY_NAME and name not in _VENDOR:
            near = difflib.get_close_matches(name, _known_names(), n=1, cutoff=TYPO_RATIO)
            if near:
                raise _misspelt(name, value, near[0])
            if name not in _WARNED:
                _WARNED.add(name)
                warnings.warn(f"{name} is not a variable fleetlike reads; it is ignored (the knobs are "
                              f"{', '.join(k.name for k in KNOBS)} and AIACC's and TI-ACC's {', '.join(_VENDOR)})",
                              UserWarning, stacklevel=2)
            continue
        found[name] = value
    return found


def knob_options(environ: Mapping[str, str]) -> Options:
    """The strategy options (flat ``"section.key"`` paths) the knobs of ``environ`` set, in
    name order; `KnobError` names a bad or refused variable, its value, why and what to use."""
    knobs = applied_knobs(environ)
    out: Options = {}
    for name, value in knobs.items():
        spec: Knob | VendorKnob = _BY_NAME[name] if name in _BY_NAME else _VENDOR[name]
        refused = getattr(spec, "refused", None)
        if refused is not None and getattr(spec, "parse", None) is None:
            raise KnobError(f"{name}={value!r} is not supported: {refused}")
        try:
            options = spec.parse(value)  # type: ignore[misc]
        except (KeyError, ValueError):
            why = f" ({refused})" if refused else ""
            raise KnobError(f"{name}={value!r} is not accepted; use {spec.accepted}{why}") from None
        for path, chosen in options.items():
            if path in out and out[path] != chosen:
                raise KnobError(f"{name}={value!r} sets {path}={chosen!r}, but another variable of this environment "
                                f"sets it to {out[path]!r}; keep one of them")
            out[path] = chosen
    scale = [n for n in _SCALES if n in knobs]
    if "PERSEUS_ALLREDUCE_DTYPE" in knobs and out.get("fp16_allreduce") and not scale:
        out[f"{_F16}.grad_scale"] = 10.0  # AIACC's documented default scale around its fp16 cast
    return out


_SCALES = (envvars.GRADIENT_SCALE, "PERSEUS_ALLREDUCE_GRADIENT_SCALE")


def apply_knobs(strategy: Any, environ: Mapping[str, str]) -> dict[str, str]:
    """Apply the knobs of ``environ`` to ``strategy`` (a `DistributedStrategy`, all-or-nothing)
    and return them by name; `KnobError` for a bad, refused or misspelt one, and for a gradient
    scale without a 16-bit allreduce (it would scale nothing)."""
    options = knob_options(environ)
    if options:
        nested: dict[str, Any] = {}
        for path, value in options.items():
            head, dot, tail = path.partition(".")
            if dot:
                nested.setdefault(head, {})[tail] = value
            else:
                nested[head] = value
        strategy.update(nested)
    knobs = applied_knobs(environ)
    scale = [n for n in _SCALES if n in knobs]
    if scale and not strategy.fp16_allreduce:
        raise KnobError(
            f"{scale[0]}={knobs[scale[0]]!r} scales gradients around a 16-bit cast, but the allreduce stays fp32; set "
            "FLEETLIKE_ALLREDUCE_DTYPE to fp16, bf16 or mixed (PERSEUS_ALLREDUCE_DTYPE to 0 or 2), or unset "
            f"{scale[0]}")
    return knobs

"""Checks across the keys of one option section: values fine alone, wrong together.

Why a module of its own: a `Section` runs its check on the merged keys after every
assignment, so the registry (`fleetlike.config.options`) names each check and this module holds
what it judges (an AMP op both forced low and kept float32, local SGD fragments that do not
divide k_steps, Nesterov without momentum, tensor parallelism asked for). Checks between
different options or features are `fleetlike.config.rules`' job.

Example:
    >>> outer_check("localsgd_configs", {"outer_optimizer": "nesterov", "outer_momentum": 0.0})
    Traceback (most recent call last):
    ...
    fleetlike.config.fields.StrategyValueError: localsgd_configs.outer_momentum=0.0 must be > 0 ...
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fleetlike.config.fields import StrategyValueError

__all__ = ["amp_lists_disjoint", "hybrid_check", "localsgd_check", "outer_check"]


def amp_lists_disjoint(section: str, merged: Mapping[str, Any]) -> None:
    """An op cannot be forced to low precision and kept in float32 at the same time."""
    both = sorted(set(merged["custom_white_list"]) & set(merged["custom_black_list"]))
    if both:
        field = f"{section}.custom_white_list and {section}.custom_black_list"
        raise StrategyValueError(
            field, both, "disjoint lists",
            "remove each op from one of the lists (update both keys in one assignment to move it)",
            f"{field} must be disjoint, got {both!r} in both. Fix: remove each op from one of the "
            "lists (update both keys in one assignment to move an op from one list to the other).",
        )
    start, end = int(merged["policy_start_time"]), int(merged["policy_end_time"])
    if end and end < start:
        raise StrategyValueError(
            f"{section}.policy_end_time", end, f">= policy_start_time={start}, or 0 for no end",
            "move the end after the start (update both keys in one assignment), or 0 for no end",
            f"{section}.policy_end_time={end} is before {section}.policy_start_time={start}. Fix: "
            "move the end after the start (update both keys in one assignment), or use 0 for no end")
    slow, fast = float(merged["policy_loss_slow"]), float(merged["policy_loss_fast"])
    if slow > fast:
        raise StrategyValueError(
            f"{section}.policy_loss_slow", slow, f"<= policy_loss_fast={fast:g}",
            "the normal band is policy_loss_slow <= decrease <= policy_loss_fast",
            f"{section}.policy_loss_slow={slow:g} is above {section}.policy_loss_fast={fast:g}. Fix: "
            "the normal band is policy_loss_slow <= relative decrease <= policy_loss_fast")


def localsgd_check(section: str, merged: Mapping[str, Any]) -> None:
    """Fragments must split k evenly, the overlap must end before the fragment syncs again,
    and Nesterov needs momentum."""
    k, fragments, overlap = int(merged["k_steps"]), int(merged["fragments"]), int(merged["overlap"])
    if k % fragments:
        raise StrategyValueError(
            f"{section}.fragments", fragments, f"a divisor of k_steps={k}",
            "choose fragments that divides k_steps (each fragment syncs every k_steps, staggered "
            "by k_steps/fragments)",
            f"{section}.fragments={fragments} must divide {section}.k_steps={k}. Fix: choose a "
            "divisor of k_steps, or change k_steps (update both keys in one assignment)")
    if overlap >= k // fragments:
        raise StrategyValueError(
            f"{section}.overlap", overlap, f"< k_steps/fragments = {k // fragments}",
            "a fragment's allreduce must land before the next fragment's starts",
            f"{section}.overlap={overlap} must be below k_steps/fragments={k // fragments}: a "
            "fragment's allreduce has to land before the next one is launched. Fix: lower "
            "overlap, or raise k_steps (update both keys in one assignment)")
    alpha = float(merged["overlap_alpha"])
    if not 0.0 <= alpha <= 1.0:
        raise StrategyValueError(
            f"{section}.overlap_alpha", alpha, "a number in [0, 1]",
            "use 0.5 (Streaming DiLoCo) or 0 (keep only the outer result)",
            f"{section}.overlap_alpha={alpha!r} must be in [0, 1]. Fix: use 0.5 (Streaming "
            "DiLoCo) or 0 (keep only the outer result)")
    outer_check(section, merged)


def outer_check(section: str, merged: Mapping[str, Any]) -> None:
    momentum = float(merged["outer_momentum"])
    if momentum < 0:
        raise StrategyValueError(
            f"{section}.outer_momentum", momentum, "a number in [0, 1)", "use 0 for none, 0.9 as DiLoCo",
            f"{section}.outer_momentum={momentum!r} must be in [0, 1). Fix: use 0 for no momentum, "
            "0.9 as DiLoCo")
    if str(merged["outer_optimizer"]) == "nesterov" and not float(merged["outer_momentum"]) > 0:
        raise StrategyValueError(
            f"{section}.outer_momentum", merged["outer_momentum"], "> 0 with outer_optimizer='nesterov'",
            "set outer_momentum (DiLoCo uses 0.9) or use outer_optimizer='sgd'",
            f"{section}.outer_momentum={merged['outer_momentum']!r} must be > 0 with "
            "outer_optimizer='nesterov'. Fix: set outer_momentum (DiLoCo uses 0.9) or use "
            "outer_optimizer='sgd'")

def hybrid_check(section: str, merged: Mapping[str, Any]) -> None:
    """Tensor (model) parallelism is not offered: refuse it here, with the reason."""
    mp = int(merged["mp_degree"])
    if mp != 1:
        raise StrategyValueError(
            f"{section}.mp_degree", mp, "1 (tensor parallelism is not offered)",
            "leave mp_degree at 1; split a model larger than one device into pipeline stages "
            "(pp_degree) or shard its optimizer state (sharding)",
            f"{section}.mp_degree={mp}: tensor (model) parallelism is not offered by fleetlike, "
            "so no layer is split across ranks. Fix: leave mp_degree at 1 and use pp_degree "
            "(pipeline stages) or sharding for a model larger than one device")
    dp = int(merged["dp_degree"])
    if dp == 0 or dp < -1:
        raise StrategyValueError(
            f"{section}.dp_degree", dp, "-1 (the world size / pp_degree) or >= 1",
            "use -1 to take every rank left over by the pipeline",
            f"{section}.dp_degree={dp} must be -1 (world size / pp_degree) or a positive count. "
            "Fix: use -1 to take every rank the pipeline leaves")

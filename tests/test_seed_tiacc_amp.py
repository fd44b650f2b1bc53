"""TI-ACC's adaptive mixed-precision example (seed 001, "使用自适应混合精度优化（PyTorch）") in a
2-rank DDP loop, with only the vendor import changed, against the same DDP script whose
``mixed_precision`` comes from the page's parameter table's rules computed by hand.

The page's lines::

    import tiacc_training.torch                      # -> from fleetlike import tiacc_torch_warp
    import torch.cuda.amp as amp
    scaler = amp.GradScaler()
    policy = tiacc_training.torch.tiacc_torch_warp.MixedPrecision_TrainingPolicy(
        policy, start_step, hold_step, end_step, test_interval, test_step)
    mixed_precision = policy.enable_mixed_precision(epoch, lr, loss, scaler=scaler)
    with amp.autocast(enabled=mixed_precision):
        outputs = model(inputs)
        loss = criterion(outputs, targets)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()

The policy only decides on or off; the dtype is the script's autocast. ``torch.cuda.amp`` is
disabled on a process without CUDA, so on CPU ``amp`` is torch.amp's CPU form (``GradScaler("cpu")``,
``autocast("cpu")``: bfloat16 by default, float16 when asked). Both runs take the same decisions,
so their parameters agree to float32 rounding; a run that never enables AMP differs, so the
decisions are what is compared.
"""

from __future__ import annotations

import functools
import types

import pytest
import torch
import torch.nn.functional as F

from dp_common import batch, make_model, max_diff, params, torch_group
from fleetlike.testing import run_ranks

EPOCHS, ITERS = 9, 2


def _cpu_amp(dtype: torch.dtype) -> types.SimpleNamespace:
    """``torch.cuda.amp``'s two names in their CPU form (the script's ``amp``)."""
    return types.SimpleNamespace(GradScaler=functools.partial(torch.amp.GradScaler, "cpu"),
                                 autocast=functools.partial(torch.autocast, "cpu", dtype=dtype))


def _script(role, make_policy, decide, dtype, lr_steps):
    """The page's loop in a DDP script; ``make_policy()`` and ``decide(policy, epoch, lr, loss,
    scaler)`` are the only vendor lines. Returns the parameters and each epoch's decision."""
    amp = _cpu_amp(dtype)
    model = torch.nn.parallel.DistributedDataParallel(make_model(100 + role.rank))
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=lr_steps, gamma=0.5)
    scaler = amp.GradScaler()
    policy = make_policy()
    loss, decisions = None, []
    for epoch in range(EPOCHS):
        lr = sched.get_last_lr()[0]
        mixed_precision = decide(policy, epoch, lr, None if loss is None else float(loss), scaler)
        decisions.append(bool(mixed_precision))
        for it in range(ITERS):
            feed = batch(epoch * ITERS + it, role.rank)
            inputs, targets = feed["x"], feed["y"]
            optimizer.zero_grad()
            with amp.autocast(enabled=mixed_precision):
                outputs = model(inputs)
                loss = criterion(outputs.float(), targets)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        sched.step()
    return params(model.module), decisions


# ------------------------------------------------------------------ the vendor lines


def _example_policy():
    """The example's positional call: time policy (0), AMP from epoch 3 through 6."""
    from fleetlike import tiacc_torch_warp  # was: import tiacc_training.torch

    policy, start_step, hold_step, end_step, test_interval, test_step = 0, 3, None, 6, 1000, 100
    return tiacc_torch_warp.MixedPrecision_TrainingPolicy(policy, start_step, hold_step, end_step, test_interval,
                                                          test_step)


def _example_call(policy, epoch, lr, loss, scaler):
    return policy.enable_mixed_precision(epoch, lr, loss, scaler=scaler)


def _table_policy():
    """The parameter table's keywords: time-lr policy (1), window [1, 8], held 2 epochs after an
    lr change."""
    from fleetlike import adaptfp16

    return adaptfp16.MixedPrecision_TrainingPolicy(policy=1, start_time=1, end_time=8, hold_time=2)


def _table_loss_policy():
    """The table's keywords for the loss policy (2): checks in epochs [3, 5) and [6, 8)."""
    import fleetlike

    return fleetlike.MixedPrecision_TrainingPolicy(2, interval_time=3, interval_hold_time=2)


def _table_call(policy, epoch, lr, loss, scaler):
    return policy.enable_mixed_precision(epoch, scaler, lr=lr, loss=loss)


# ------------------------------------------------------------------ the table's rules by hand


class _ByHand:
    """The page's rules, written from its parameter table: 0 on in [start, end]; 1 as 0 and off
    for ``hold`` epochs from an lr change; 2 inside the windows [j*interval, j*interval+hold),
    j >= 1, off when the loss fell faster than 0.5 or rose against the previous epoch's."""

    def __init__(self, kind, start=10, end=None, hold=None, interval=1000, interval_hold=100):
        self.kind, self.start, self.end, self.hold = kind, start, end, hold
        self.interval, self.interval_hold = interval, interval_hold
        self.lrs, self.losses = [], []

    def __call__(self, _policy, epoch, lr, loss, _scaler):
        self.lrs.append(lr)
        self.losses.append(loss)
        window = self.start <= epoch and (self.end is None or epoch <= self.end)
        if self.kind == 0:
            return window
        if self.kind == 1:
            changes = [t for t in range(1, len(self.lrs)) if self.lrs[t] != self.lrs[t - 1]]
            return window and not any(c <= epoch < c + self.hold for c in changes)
        j = epoch // self.interval
        if j < 1 or epoch >= j * self.interval + self.interval_hold:
            return True
        prev, now = (self.losses[-2] if len(self.losses) > 1 else None), loss
        if prev is None or now is None:
            return True
        d = (prev - now) / abs(prev)
        return 0.0 <= d <= 0.5


#: label -> (vendor policy, vendor call, the hand rule's arguments, autocast dtype, lr milestones)
CASES = {
    "example_time": (_example_policy, _example_call, dict(kind=0, start=3, end=6), torch.bfloat16, [4]),
    "table_time_lr": (_table_policy, _table_call, dict(kind=1, start=1, end=8, hold=2), torch.float16, [3, 6]),
    "table_loss": (_table_loss_policy, _table_call, dict(kind=2, interval=3, interval_hold=2), torch.bfloat16, [4]),
}


def _job(role, rendezvous):
    out = {}
    with torch_group(role, rendezvous):
        for label, (make, call, rule, dtype, steps) in CASES.items():
            out[label] = {
                "ours": _script(role, make, call, dtype, steps),
                "ddp": _script(role, lambda: None, _ByHand(**rule), dtype, steps),
                "fp32": _script(role, lambda: None, lambda *a: False, dtype, steps),
            }
    return out


@pytest.mark.timeout(120)
def test_tiacc_amp_example_and_table_forms_equal_ddp_with_the_same_decisions(tmp_path):
    results = run_ranks(_job, 2, str(tmp_path / "rdv"), timeout=100)
    for rank, out in enumerate(results):
        for label, runs in out.items():
            (ours, on), (ddp, on_ddp), (fp32, _) = runs["ours"], runs["ddp"], runs["fp32"]
            assert on == on_ddp, (rank, label, on, on_ddp)
            assert True in on and False in on, (label, on)  # the policy switches within the run
            assert max_diff(ours, ddp) <= 1e-6, (rank, label, max_diff(ours, ddp))
            assert max_diff(fp32, ddp) > 1e-5, (label, "AMP's epochs change nothing: the test could not fail")
            assert max_diff(ours, results[0][label]["ours"][0]) == 0.0  # DDP keeps the ranks equal
    assert results[0]["example_time"]["ours"][1] == [False] * 3 + [True] * 4 + [False] * 2
    # the lr halves at epochs 3 and 6: off for 2 epochs each time, on otherwise in [1, 8]
    assert results[0]["table_time_lr"]["ours"][1] == [False, True, True, False, False, True, False, False, True]

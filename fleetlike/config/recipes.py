"""Helpers for seed 003's *manual* local SGD recipe (Fleet 1.x style).

In Fleet 1.x users switched programs themselves: run ``fleet.main_program`` (which averages the
parameters) when ``step % k == 0`` and ``fleet._origin_program`` (purely local) otherwise, with k
from one of the two helpers below. They are kept exactly as the seed has them, quirks included,
so that schedules of old jobs reproduce: the warm-up helper's powers of two, the adaptive helper's
assumed loss floor of 0.6 and its guard against k jumping by more than 20.

With ``strategy.localsgd`` (``k_steps=1``, ``begin_step=1``) every ``main_program`` run averages,
so the recipe averages exactly where it runs ``main_program``. For the adaptive helper the loss
must be the same on every rank: average it first, e.g.
``cur_loss = fleet.util.all_reduce(loss, mode="sum") / fleet.worker_num()``.

Example:
    >>> k = get_local_sgd_steps(pass_id, local_sgd_steps=4, local_sgd_warmup=2)
    >>> prog = fleet.main_program if step % k == 0 else fleet._origin_program
    >>> exe.run(prog, feed=batch, fetch_list=["loss"])
"""

from __future__ import annotations

import math

__all__ = ["get_local_sgd_steps", "adaptive_local_step"]

#: the loss value the seed's adaptive helper assumes training converges to
INF_LOSS = 0.6


def get_local_sgd_steps(passid: int, local_sgd_steps: int, local_sgd_warmup: int) -> int:
    """k for epoch ``passid``: 1 during warm-up, then 1, 2, 4, ... up to ``local_sgd_steps``."""
    offset = passid - local_sgd_warmup
    if offset < 0:
        return 1
    warm_up = [2**i for i in range(local_sgd_steps) if 2**i <= local_sgd_steps]
    if offset >= len(warm_up):
        return local_sgd_steps
    return warm_up[offset]


def adaptive_local_step(
    ini_loss: float, ini_lr: float, cur_loss: float, cur_lr: float, base_step: int, pre_step: int
) -> int:
    """Seed 003's k: ``int(base_step * sqrt(ini_lr*(cur_loss-0.6) / (cur_lr*(ini_loss-0.6))))``.

    At least 1 (also for a loss below the assumed floor of 0.6, where the seed's ``math.sqrt``
    would raise); a jump above ``pre_step + 20`` (training noise) keeps ``pre_step`` instead
    (reference: arXiv:1810.08313).
    """
    fir = ini_lr * (cur_loss - INF_LOSS)
    sec = cur_lr * max((ini_loss - INF_LOSS), 1e-12)
    ratio = fir / sec
    # the seed's math.sqrt raises below the floor; "at least 1" is what it means there
    step = int(base_step * math.sqrt(ratio)) if ratio > 0 else 1
    if step < 1:
        step = 1
    if step > pre_step + 20:
        step = pre_step
    return step

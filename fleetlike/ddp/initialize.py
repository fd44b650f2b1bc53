"""``fleetlike.init_process_group()``: the one init line of a DDP script started by ``mpirun`` or ``srun``.

TI-ACC's ``tdist.init_tiacc_training()`` and AIACC's ``PERSEUS_USE_DDP_LAUNCHER=0`` mode ask a
DDP script for one line at its top; here it is

    import fleetlike; fleetlike.init_process_group()

It forms torch's default process group from the launch behind the job's secret
(`fleetlike.ddp.start.form_group`: fleetlike's launcher, torchrun, Open MPI or MPICH, Slurm) and
installs `fleetlike.auto` over it, so every DDP model of the script averages through fleetlike
with the ``FLEETLIKE_*`` knobs (``accelerate=False`` leaves DDP plain). The script's own
``dist.init_process_group(...)`` afterwards is answered by that group where it agrees, refused
where it does not. Light's ``@light_init(params={"training_framework": "pytorch_ddp"})`` calls
it before ``main`` and `release` after.

Example:
    >>> import fleetlike; fleetlike.init_process_group()     # the first line of train.py
    >>> dist.init_process_group(backend="gloo", init_method="env://")   # the script's own: answered
"""

from __future__ import annotations

import sys

from fleetlike.ddp.start import FormedGroup, form_group, formed, release_group

__all__ = ["init_process_group", "release"]


def init_process_group(backend: str | None = None, *, timeout: float | None = None,
                       accelerate: bool = True) -> FormedGroup:
    """Form torch's default group from the launch (`form_group`) and, with ``accelerate``,
    install `fleetlike.auto` (knobs checked: a bad one raises here). A second call returns what
    the first formed."""
    alive = formed()
    if alive is not None:
        return alive
    group = form_group(backend, timeout=timeout)
    if accelerate:
        before = sys.modules.get("fleetlike.ddp.auto")
        already = before is not None and before._SETTINGS is not None  # the script imported it itself
        from fleetlike.ddp import auto  # installs on import (knobs checked there)

        auto.install()  # re-reads the knobs where it was imported earlier
        group.accelerated, group.owns_auto = True, not already
    return group


def release() -> None:
    """Undo `init_process_group`: `fleetlike.auto` uninstalled where it installed it, the group
    destroyed, torch's own ``init_process_group`` back."""
    group = formed()
    if group is not None and group.owns_auto:
        from fleetlike.ddp import auto

        auto.uninstall()
    release_group()

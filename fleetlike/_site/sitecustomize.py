"""Imported by Python at start-up when ``python -m fleetlike.launch --accelerate_ddp`` (or
``--accelerate_horovod``) puts this folder first on the workers' PYTHONPATH. It serves both faces,
so it sits above them: with ``FLEETLIKE_ACCELERATE_DDP=1`` it imports `fleetlike.ddp.auto`
(``fleetlike.auto``) before the training script, with ``FLEETLIKE_ACCELERATE_HOROVOD=1`` it makes
``import horovod.torch`` resolve to `fleetlike.horovod` (`fleetlike.horovod.alias`); without them
(other Python processes the script starts with the same path) it does neither. Then it runs the
``sitecustomize`` this one shadows, if any and if it has not run in this process already (a
worker forked from a preload server that ran it at its start, `fleetlike.launch.preload`)."""

import importlib.machinery
import importlib.util
import os
import sys

if os.environ.get("FLEETLIKE_ACCELERATE_DDP") == "1":
    import fleetlike.ddp.auto  # noqa: F401
if os.environ.get("FLEETLIKE_ACCELERATE_HOROVOD") == "1":  # ``--accelerate_horovod``
    import fleetlike.horovod.alias

    fleetlike.horovod.alias.install()

_HERE = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
_ran = getattr(sys.modules.get("sitecustomize"), "__file__", None)
if _spec is not None and _spec.loader is not None and _spec.origin not in (os.path.abspath(__file__), _ran):
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)

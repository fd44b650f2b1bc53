"""``import horovod.torch as hvd`` answered by `fleetlike.horovod`: a Horovod script runs unchanged.

Light (seed 000) replaces Horovod's calls "with no code change". ``python -m fleetlike.launch
--accelerate_horovod`` does the same here: every worker's start-up (`fleetlike/_site/sitecustomize.py`) calls
`install`, which puts a finder first on ``sys.meta_path`` that answers

* ``horovod`` with a small package of its own (``horovod.__version__`` says whose it is),
* ``horovod.torch`` with `fleetlike.horovod` itself, and ``horovod.torch.X`` with
  ``fleetlike.horovod.X`` where that module exists (``horovod.torch.elastic``, ...),
* any other ``horovod.*`` (``horovod.tensorflow``, ``horovod.keras``, ``horovod.spark``, ...) with an
  ImportError saying fleetlike serves PyTorch only,

lazily: nothing is imported until the script imports ``horovod``. Without the flag nothing is
installed, and a real Horovod, if installed, is what ``import horovod`` finds.

Example:
    $ python -m fleetlike.launch --nproc_per_node=2 --accelerate_horovod train_hvd.py
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence
from typing import Any

__all__ = ["HorovodFinder", "install", "installed", "uninstall"]

_TARGET = "fleetlike.horovod"


class _Existing(importlib.abc.Loader):
    """Hands over a module that exists already (or a fresh shim package for ``horovod``)."""

    def __init__(self, module: types.ModuleType) -> None:
        self.module = module

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return self.module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class HorovodFinder(importlib.abc.MetaPathFinder):
    """The finder `install` puts first on ``sys.meta_path``."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "horovod" and not fullname.startswith("horovod."):
            return None
        if fullname == "horovod":
            shim = types.ModuleType("horovod", "fleetlike's stand-in for Horovod (--accelerate_horovod)")
            shim.__path__ = []  # a package: its submodules are found by this finder
            shim.__version__ = "fleetlike"  # type: ignore[attr-defined]
            return importlib.util.spec_from_loader(fullname, _Existing(shim), is_package=True)
        parts = fullname.split(".")
        if parts[1] != "torch":
            raise ImportError(f"{fullname}: fleetlike stands in for Horovod's PyTorch API only "
                              f"(horovod.torch); {'.'.join(parts[:2])} is another framework's", name=fullname)
        real = ".".join([_TARGET, *parts[2:]])
        try:
            module = importlib.import_module(real)
        except ModuleNotFoundError:
            raise ImportError(f"{fullname}: fleetlike.horovod has no {real} (the Horovod API it stands in for "
                              "is documented in docs/eager.md)", name=fullname) from None
        return importlib.util.spec_from_loader(fullname, _Existing(module), is_package=hasattr(module, "__path__"))


_FINDER: HorovodFinder | None = None


def installed() -> bool:
    return _FINDER is not None and _FINDER in sys.meta_path


def install() -> None:
    """Answer ``import horovod.torch`` with `fleetlike.horovod` from now on in this process."""
    global _FINDER
    if installed():
        return
    _FINDER = HorovodFinder()
    sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    """Stop answering (modules imported meanwhile stay imported)."""
    global _FINDER
    if _FINDER is not None and _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    _FINDER = None
    for name in [n for n in sys.modules if n == "horovod" or n.startswith("horovod.")]:
        del sys.modules[name]

"""Run a script as ``python SCRIPT ARGS`` would, with some modules made unimportable first.

Usage: without_modules.py NAME[,NAME...] SCRIPT ARGS...
Each NAME (and every submodule already imported under it) is set to None in ``sys.modules``, so
the script's ``import NAME`` fails as where NAME is not installed: a check that the script
needs none of them.
"""

import runpy
import sys

names = sys.argv[1].split(",")
for loaded in [m for m in sys.modules if m.split(".")[0] in names]:
    sys.modules[loaded] = None  # type: ignore[assignment]
sys.modules.update(dict.fromkeys(names))
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")

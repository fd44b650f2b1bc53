"""Run several scripts one after another in this worker, each as ``python SCRIPT`` would run it.

One launcher job then checks many examples or many strategies: starting the job (processes,
rendezvous) costs more than the few steps each case trains. Between cases the previous case's
variables are removed, the next case's set, and ``fleet.shutdown()`` ends what the script's
process end would have ended; each case's ``fleet.init`` then meets the other ranks afresh.

Usage: in_turn.py CASES.json
CASES.json: a list of ``{"name": ..., "script": PATH, "env": {VAR: VALUE}}``. Each case's output
is framed by ``=== begin NAME`` and ``=== end NAME`` lines (see `tests/helpers.py` ``case_logs``).
"""

import json
import os
import runpy
import sys

from fleetlike import fleet


def main() -> None:
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    base_path = list(sys.path[1:])
    previous: dict[str, str] = {}
    for case in cases:
        for name in previous:
            os.environ.pop(name, None)
        os.environ.update(case["env"])
        previous = case["env"]
        script = os.path.abspath(case["script"])
        sys.argv = [script]
        sys.path[:] = [os.path.dirname(script), *base_path]
        print(f"=== begin {case['name']}", flush=True)
        runpy.run_path(script, run_name="__main__")
        fleet.shutdown()
        print(f"=== end {case['name']}", flush=True)


if __name__ == "__main__":
    main()

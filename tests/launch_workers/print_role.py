"""Test worker: write this process's detected role (and MPIRoleMaker's, if asked) as JSON.

Usage: print_role.py OUT_DIR [--mpi]   ->   OUT_DIR/role.<rank>.json
"""

import dataclasses
import json
import os
import sys

from fleetlike import roles


def main() -> None:
    out = sys.argv[1]
    if "--mpi" in sys.argv[2:]:
        maker = roles.MPIRoleMaker()
        role = maker.role
        extra = {"mpi_comm": maker.mpi_comm is not None, "env_role": dataclasses.asdict(roles.detect_role())}
    else:
        role = roles.detect_role()
        extra = {}
    with open(os.path.join(out, f"role.{role.rank}.json"), "w") as f:
        master = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
        json.dump({"role": dataclasses.asdict(role), **master, **extra}, f)


if __name__ == "__main__":
    main()

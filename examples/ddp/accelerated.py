"""examples/ddp/main.py with the one line AIACC asks for: ``import fleetlike.auto`` first.

    FLEETLIKE_ALLREDUCE_MODE=hierarchical FLEETLIKE_ALLREDUCE_DTYPE=fp16 \
        torchrun --nproc_per_node=2 examples/ddp/accelerated.py --epochs 1
"""

import fleetlike.auto  # noqa: F401  (the one line; everything below is the unchanged script)

import os
import runpy

runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "main.py"), run_name="__main__")

"""hvd.DistributedOptimizer in an elastic job: refused at construction, naming the fix.

Usage: elastic_hvd_optimizer.py OUT    Writes OUT/pid.<pid>, then builds the optimizer (which
raises) after hvd.init(); reaching the end would write OUT/built.<pid>.
"""

import os
import sys
from pathlib import Path

import torch

import fleetlike.horovod as hvd

out = Path(sys.argv[1])
(out / f"pid.{os.getpid()}").write_text(str(os.getpid()))
hvd.init(timeout=30.0)
net = torch.nn.Linear(4, 2)
opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters())
(out / f"built.{os.getpid()}").write_text("built")

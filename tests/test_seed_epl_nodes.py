"""EPL's ``Config`` form on 2 loopback nodes x 2 ranks (``python -m fleetlike.launch`` on 127.0.0.1 and
127.0.0.2): the page's gradient-checkpoint example and the communication keys (a sum of gradients
each clipped before the allreduce) equal a single process that computes the four ranks' gradients
and combines them by hand."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from helpers import max_diff, preload_env, run_jobs
from test_reduce_clip import hand_reference

WORKERS = Path(__file__).resolve().parent / "launch_workers"
sys.path.insert(0, str(WORKERS))
import epl_config  # noqa: E402 - the worker's model, data and Configs

# its jobs fill both cores by themselves (see conftest)
pytestmark = pytest.mark.alone


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FLEETLIKE_", "PADDLE_", "TORCHELASTIC")) and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    env.update(preload_env())
    return env


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_epl_config_on_two_nodes_of_two_ranks_equals_the_hand_reference(tmp_path: Path) -> None:
    ips = ("127.0.0.1", "127.0.0.2")
    procs = run_jobs([
        [sys.executable, "-m", "fleetlike.launch", f"--cluster_node_ips={','.join(ips)}", f"--node_ip={ip}",
         "--started_port=auto", f"--rendezvous_file={tmp_path / 'rdzv'}", "--nproc_per_node=2",
         f"--log_dir={tmp_path / f'log{node}'}", str(WORKERS / "epl_config.py"), str(tmp_path)]
        for node, ip in enumerate(ips)], cwd=tmp_path, envs=[_env()] * 2, timeout=180)
    logs = "".join(f.read_text() for f in sorted(tmp_path.glob("log*/workerlog.*")))
    for p in procs:
        assert p.returncode == 0, p.stdout + logs
    for label, keys in epl_config.CONFIGS.items():
        ref, coefs = hand_reference(keys, world=4, model=epl_config.Net(), feed=epl_config.feed, loss=epl_config.loss,
                                    steps=epl_config.STEPS, lr=epl_config.LR)
        if coefs:
            assert min(coefs) < 0.9, coefs  # the clip binds
        for rank in range(4):
            saved = torch.load(tmp_path / f"{label}.{rank}.pt")
            got = [p.numpy() for p in saved["params"]]
            assert max_diff(got, ref) <= 1e-6, (label, rank, max_diff(got, ref))
        applied = torch.load(tmp_path / f"{label}.0.pt")["applied"]
        if label == "gc_auto":
            assert any(a.startswith("recompute: applied") for a in applied), applied
        else:
            assert "sharding_configs.gradients_reduce_method: applied (gradients summed over 4 ranks)" in applied, applied
            assert any("before the allreduce" in a for a in applied), applied

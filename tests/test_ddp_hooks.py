"""fleetlike's DDP communication hook against plain PyTorch DDP, on real gloo ranks.

One world of 4 ranks on 2 loopback "nodes" runs every configuration side by side with plain
``DistributedDataParallel`` (its own allreduce), from the same initial model and the same
per-rank batches:

* fp32 flat, hierarchical, hierarchical on 2 communicators: parameters equal DDP's exactly
  (integer-valued data and 1/8-dyadic weights keep every sum exact, whatever the order);
* fp16 (all hops): equal to DDP with torch's own fp16_compress_hook exactly; fp16, bf16 and
  mixed (fp16 across nodes only) within the codec's rounding bound of plain DDP;
* local accumulation of 3 passes == DDP with ``no_sync()`` for 2 passes, exactly; also through
  `fleetlike.auto` with an unchanged loop that steps after every batch;
* gossip n=4: 1/4 of the bytes per step, the same parameters on every rank;
* the NaN check names the parameter, the rank where it started, and every rank stops;
* the slow-rank report is the core's (`strategies.health.SlowRankWindow`): a rank with slow
  own work, then a rank waiting on its data, named with host and cause as in the other faces;
* the state pickles without communicators and resumes to the same parameters.
"""

from __future__ import annotations

import copy
import logging
import pickle
import re
import time

import numpy as np
import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_common import dyadic_batch, dyadic_model
from dp_common import torch_group
from fleetlike import DistributedStrategy
from fleetlike.comm import CommGroups
from fleetlike.ddp import FleetHookState, fleetlike_hook, register
from fleetlike.strategies.health import DATA_WAIT, SlowRankWindow
from fleetlike.testing import make_world, run_ranks

STEPS = 4
LR = 0.125


_model, _batch = dyadic_model, dyadic_batch


def _train(ddp: DDP, rank: int, steps: int = STEPS, accumulate: int = 1, start: int = 0,
           no_sync: bool = False) -> list[np.ndarray]:
    """SGD steps; ``accumulate`` backward passes per step, the first ones under DDP's
    ``no_sync()`` when ``no_sync`` (the reference), else left to the hook's accumulation."""
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    for step in range(start, start + steps):
        for micro in range(accumulate):
            x, t = _batch(rank, step * accumulate + micro)
            ctx = ddp.no_sync() if no_sync and micro < accumulate - 1 else _null()
            with ctx:
                (ddp(x) * t).sum().backward()  # linear in the output: integer gradients upstream
        opt.step()
        opt.zero_grad()
    return [p.detach().numpy().copy() for p in ddp.parameters()]


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _ddp(**kw: object) -> DDP:
    return DDP(_model(), bucket_cap_mb=0.0005, **kw)  # ~500 bytes: several buckets


def _cases(role, rendezvous: str) -> dict[str, object]:
    world = make_world(role)
    groups = CommGroups(world, role)
    out: dict[str, object] = {}
    with torch_group(role, rendezvous):
        out["ddp"] = _train(_ddp(), role.rank)
        out["ddp_nosync3"] = _train(_ddp(), role.rank, accumulate=3, no_sync=True)
        ddp = _ddp()  # (torch's bf16_compress_hook needs CUDA and NCCL)
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        out["torch_fp16"] = _train(ddp, role.rank)
        configs = {
            "flat": DistributedStrategy(),
            "hier": DistributedStrategy(use_hierarchical_allreduce=True),
            "hier2": DistributedStrategy(use_hierarchical_allreduce=True, nccl_comm_num=2),
            "flat3": DistributedStrategy(nccl_comm_num=3),
            "fp16": DistributedStrategy(fp16_allreduce=True),
            "bf16": DistributedStrategy(fp16_allreduce=True, fp16_allreduce_configs={"dtype": "bfloat16"}),
            "mixed": DistributedStrategy(fp16_allreduce=True, fp16_allreduce_configs={"mode": "mixed"}),
            "acc3": DistributedStrategy(gradient_merge=True, gradient_merge_configs={"k_steps": 3}),
            "gossip": DistributedStrategy(gossip=True, gossip_configs={"downsample_n_elements": 4}),
        }
        states = {}
        for name, s in configs.items():
            ddp = _ddp()
            if name == "flat3":  # by hand, as torch's own hooks are registered
                states[name] = FleetHookState(s, groups=groups, model=ddp)
                ddp.register_comm_hook(states[name], fleetlike_hook)
            else:
                states[name] = register(ddp, s, groups=groups)
            out[name] = _train(ddp, role.rank, accumulate=3 if name == "acc3" else 1)
        out["notes"] = {n: st.notes for n, st in states.items()}
        # gossip bytes: the sent elements of each bucket, per step (DDP's final bucket layout)
        sizes = sum(p.numel() for p in _model().parameters())
        before = world.stats.snapshot()["bytes"].get("all_reduce", 0)
        ddp = _ddp()
        register(ddp, DistributedStrategy(gossip=True, gossip_configs={"downsample_n_elements": 4}), groups=groups)
        _train(ddp, role.rank, steps=1)
        after1 = world.stats.snapshot()["bytes"].get("all_reduce", 0)
        _train(ddp, role.rank, steps=1, start=1)
        after2 = world.stats.snapshot()["bytes"].get("all_reduce", 0)
        out["gossip_bytes"] = (after1 - before, after2 - after1, sizes * 4)
        # checkpoint: pickle the state after 2 steps, resume in a fresh state, compare with 4 steps
        ddp = _ddp()
        st = register(ddp, configs["gossip"], groups=groups)
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)
        for step in range(2):
            x, t = _batch(role.rank, step)
            (ddp(x) * t).sum().backward()
            opt.step()
            opt.zero_grad()
        blob = pickle.dumps(st)
        model_state = copy.deepcopy(ddp.module.state_dict())
        ddp2 = DDP(_model(), bucket_cap_mb=0.0005)
        ddp2.module.load_state_dict(model_state)
        resumed = pickle.loads(blob)
        assert resumed.collective is None  # the communicators were dropped
        resumed.connect(groups)
        register(ddp2, resumed)
        opt2 = torch.optim.SGD(ddp2.parameters(), lr=LR)
        for step in range(2, 4):
            x, t = _batch(role.rank, step)
            (ddp2(x) * t).sum().backward()
            opt2.step()
            opt2.zero_grad()
        out["resumed"] = [p.detach().numpy().copy() for p in ddp2.parameters()]
        # fleetlike.auto with FLEETLIKE_ACCUMULATE_N_STEPS=3 and an unchanged loop (zero_grad,
        # backward, step after every batch): the same as DDP with no_sync over 3 batches
        import fleetlike.auto as auto

        auto.install({"FLEETLIKE_ACCUMULATE_N_STEPS": "3"})
        try:
            auto.settings().groups = groups  # the test's world (the import would meet it from env)
            ddp = _ddp()
            opt = torch.optim.SGD(ddp.parameters(), lr=LR)
            for i in range(3 * STEPS):
                x, t = _batch(role.rank, i)
                opt.zero_grad()
                (ddp(x) * t).sum().backward()
                opt.step()
            out["auto_acc3"] = [p.detach().numpy().copy() for p in ddp.parameters()]
        finally:
            auto.uninstall()
        out["slow"] = _slow_ranks(groups, role.rank)
        # NaN check: rank 2's input holds a NaN; every rank raises, naming parameter and origin
        ddp = _ddp()
        register(ddp, DistributedStrategy(check_nan_inf=True), groups=groups)
        x, t = _batch(role.rank, 0)
        if role.rank == 2:
            x[0, 0] = float("nan")
        try:
            (ddp(x) * t).sum().backward()
            out["nan"] = "no error"
        except Exception as exc:  # noqa: BLE001 - DDP wraps the hook's error
            out["nan"] = str(exc)
    return out


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _slow_ranks(groups: CommGroups, rank: int) -> dict[str, object]:
    """Windows of 2 passes: the first is warm-up (DDP's second forward rebuilds its buckets
    with a collective, so every rank waits there for the slowest), then rank 2's own work is
    slow (a 0.5 s sleep before each forward), then rank 3 waits 1 s per step on its data
    (recorded as fleetlike.io's loaders record it). Both are far past 10x the others' step
    even with 4 ranks and a busy loop on 2 cores (0.1 s was not: the others' steps took
    over 10 ms there)."""
    ddp = _ddp()
    s = DistributedStrategy(slow_rank_check=True, slow_rank_check_configs={"every_n_steps": 2, "factor": 10.0})
    st = register(ddp, s, groups=groups)
    handler = _Lines()
    reports = []
    try:
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)
        for step in range(6):
            if step == 2:
                logging.getLogger("fleetlike").addHandler(handler)
            if rank == 2 and step in (2, 3):
                time.sleep(0.5)
            if rank == 3 and step in (4, 5):
                DATA_WAIT.record(1.0)
            x, t = _batch(rank, step)
            (ddp(x) * t).sum().backward()
            opt.step()
            opt.zero_grad()
            if step in (3, 5):
                reports.append((list(st.slow), list(st.data_wait)))
    finally:
        logging.getLogger("fleetlike").removeHandler(handler)
    core = isinstance(st.perf, SlowRankWindow) and st.perf.last is not None and st.perf.last.slow_ranks == st.slow
    return {"reports": reports, "lines": [m for m in handler.lines if m.startswith("slow rank")], "core": core}


@pytest.mark.timeout(120)
def test_hooks_match_plain_ddp(tmp_path):
    results = run_ranks(_cases, 4, str(tmp_path / "rdzv"), nodes=2, timeout=100)
    ref = results[0]["ddp"]
    for r, res in enumerate(results):
        for name in ("flat", "hier", "hier2", "flat3"):
            for a, b in zip(res[name], ref):
                np.testing.assert_array_equal(a, b, err_msg=f"{name} rank {r}")
        for a, b, c in zip(res["acc3"], res["auto_acc3"], res["ddp_nosync3"]):
            np.testing.assert_array_equal(a, c, err_msg=f"accumulate rank {r}")
            np.testing.assert_array_equal(b, c, err_msg=f"fleetlike.auto accumulate rank {r}")
        for a, b in zip(res["fp16"], res["torch_fp16"]):  # the same codec as torch's fp16 hook
            np.testing.assert_array_equal(a, b, err_msg=f"fp16 vs torch's fp16_compress_hook, rank {r}")
        for name, bound in (("fp16", 2e-3), ("bf16", 2e-2), ("mixed", 2e-3)):
            err = max(float(np.abs(a - b).max() / (np.abs(b).max() + 1e-12)) for a, b in zip(res[name], ref))
            assert err < bound, (name, r, err)
        assert "contains NaN or Inf" in res["nan"] and f"rank {r}:" in res["nan"], res["nan"]
        assert ("began on this rank" in res["nan"]) == (r == 2), res["nan"]
        assert "0.weight" in res["nan"], res["nan"]
        slow = res["slow"]
        assert slow["core"]  # the report is the core's SlowRankWindow's, not the face's own
        (first_slow, _), (second_slow, waits) = slow["reports"]
        assert [(rk, host) for rk, host, _ in first_slow] == [(2, "127.0.0.2")], first_slow
        assert [(rk, host) for rk, host, _ in second_slow] == [(3, "127.0.0.2")], second_slow
        assert second_slow[0][2] >= 1.0 and waits[3] >= 1.0 and max(waits[:3]) < 0.01, (second_slow, waits)
        if r == 0:  # the log line of every face (strategies.health), cause named for the data wait
            own = r"slow rank (\d) on 127\.0\.0\.2: [0-9.]+s of own work per step, [0-9.]+x the median [0-9.]+s"
            assert len(slow["lines"]) == 2 and re.fullmatch(own.replace("(\\d)", "2"), slow["lines"][0]), slow["lines"]
            assert re.fullmatch(own.replace("(\\d)", "3") + r" \(its input pipeline: waited on data 1(\.\d*)?s\)",
                                slow["lines"][1]), slow["lines"]
        else:
            assert slow["lines"] == []
        first, second, full = res["gossip_bytes"]
        assert abs(second - full / 4) <= 4 * 8, (second, full)  # ceil per bucket: a few elements
        assert first <= full / 4 + 32
    notes = results[0]["notes"]
    assert any(n == "use_hierarchical_allreduce" and ok for n, ok, _ in notes["hier"])
    assert any(n == "fp16_allreduce" and ok and "mixed" in why for n, ok, why in notes["mixed"])
    # gossip and its checkpoint: every rank equal; the resumed run equals the uninterrupted one
    for r in range(4):
        for a, b in zip(results[r]["gossip"], results[0]["gossip"]):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(results[r]["resumed"], results[0]["gossip"]):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    # gossip is not plain DDP: updates of the elements not sent are delayed
    assert any(float(np.abs(a - b).max()) > 0 for a, b in zip(results[0]["gossip"], ref))


def test_every_fleetlike_variable_the_package_reads_is_a_knob_or_known() -> None:
    """`import fleetlike.auto` stops on an unknown FLEETLIKE_* variable: one the launcher or
    another layer sets (elastic's, the -np/-H form's) must never trip it."""
    import pathlib
    import re

    from fleetlike.ddp import knobs

    root = pathlib.Path(knobs.__file__).resolve().parents[1]
    names = {m for f in root.rglob("*.py") for m in re.findall(r"\bFLEETLIKE_[A-Z0-9]+(?:_[A-Z0-9]+)*\b", f.read_text())}
    names -= {n for n in names if n.endswith("_")}  # prefixes in messages
    unknown = names - knobs.KNOWN_ELSEWHERE - {k.name for k in knobs.KNOBS}
    assert not unknown, f"add these to ddp.knobs.KNOWN_ELSEWHERE (or make them knobs): {sorted(unknown)}"

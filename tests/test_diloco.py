"""DiLoCo and Streaming DiLoCo on real gloo ranks, against an in-process simulation.

The simulation below is written from the papers' description, not from fleetlike's code: N
model replicas with their own inner optimizers; per fragment an anchor held as parameters of a
real ``torch.optim.SGD`` (the outer optimizer: ``nesterov=True`` for DiLoCo) whose gradient is
the averaged ``anchor - param``; fragments landing ``k/F`` steps apart and launched ``overlap``
steps before they land, the overlapped local progress mixed back with ``alpha``. Both faces of
the library (program style and the plain loop) must equal it to 1e-6 at every step, as must a
run interrupted by a checkpoint while a fragment's allreduce is in flight.
"""

from __future__ import annotations

import tempfile
from typing import Any

import numpy as np
import pytest
import torch

from fleetlike.comm import CompletedWork
from fleetlike.strategies import DistributedStrategy
from fleetlike.strategies.fragments import OuterRule, split_fragments
from fleetlike.testing import run_ranks
from helpers import mse as loss_fn
from helpers import max_diff, regression_batch

IN, HID, OUT, BATCH = 5, 8, 2, 6
TOL = 1e-6
#: parameter indices of each fragment of `make_model` for F=2 (see test_split_fragments)
HALVES = [[0, 1, 2], [3, 4, 5, 6, 7]]


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.Tanh(), torch.nn.Linear(HID, HID), torch.nn.Tanh(),
                               torch.nn.Linear(HID, HID), torch.nn.Tanh(), torch.nn.Linear(HID, OUT))


def batch(step: int, rank: int) -> dict[str, torch.Tensor]:
    return regression_batch(step * 7919 + rank, BATCH, IN, OUT, 1.0 + rank, squash=True)


def inner_optimizer(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.AdamW(model.parameters(), lr=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def strategy(cfg: dict[str, Any]) -> DistributedStrategy:
    s = DistributedStrategy()
    keys = {k: cfg[k] for k in ("outer_optimizer", "outer_lr", "outer_momentum", "sync_dtype") if k in cfg}
    if cfg.get("adaptive"):
        s.adaptive_localsgd = True
        s.adaptive_localsgd_configs = {"init_k_steps": cfg["k"], "begin_step": cfg.get("begin", 1), **keys}
    else:
        s.localsgd = True
        s.localsgd_configs = {"k_steps": cfg["k"], "begin_step": cfg.get("begin", 1), **keys,
                              **{k: cfg[k] for k in ("fragments", "overlap", "overlap_alpha") if k in cfg}}
    s.use_hierarchical_allreduce = bool(cfg.get("hier"))
    s.nccl_comm_num = cfg.get("rings", 1)
    return s


# ---------------------------------------------------------------------- the reference


def simulate(cfg: dict[str, Any], world: int, steps: int) -> list[list[list[np.ndarray]]]:
    """Every rank's parameters after each step: ``out[step][rank][param]`` (see module doc)."""
    k, begin = cfg["k"], cfg.get("begin", 1)
    frags = cfg.get("parts") or [list(range(len(list(make_model(0).parameters()))))]
    n_frag, tau, alpha = len(frags), cfg.get("overlap", 0), cfg.get("overlap_alpha", 0.5)
    period = k // n_frag
    kind = cfg.get("outer_optimizer", "average")
    models = [make_model(0) for _ in range(world)]  # every rank starts from rank 0's parameters
    opts = [inner_optimizer(m, cfg.get("inner", "sgd")) for m in models]
    plist = [list(m.parameters()) for m in models]
    anchors = [[torch.nn.Parameter(plist[0][i].detach().clone()) for i in f] for f in frags]
    outers = [None if kind == "average" else
              torch.optim.SGD(a, lr=cfg.get("outer_lr", 0.7), momentum=cfg.get("outer_momentum", 0.9),
                              nesterov=kind == "nesterov") for a in anchors]
    pending: dict[int, list[list[torch.Tensor]]] = {}
    out = []
    for s in range(1, steps + 1):
        for r, (m, o) in enumerate(zip(models, opts)):
            o.zero_grad()
            loss_fn(m, batch(s - 1, r)).backward()
            o.step()
        with torch.no_grad():
            if s <= begin:  # warm-up: the plain average of the whole model
                for i in range(len(plist[0])):
                    mean = sum(p[i] for p in plist) / world
                    for p in plist:
                        p[i].copy_(mean)
                for f, a in zip(frags, anchors):
                    for j, i in enumerate(f):
                        a[j].copy_(plist[0][i])
            else:
                t = s - begin
                if t >= period and t % period == 0:
                    f = (t // period - 1) % n_frag
                    deltas = pending.pop(f, None)
                    if deltas is None:
                        deltas = [[anchors[f][j] - plist[r][i] for j, i in enumerate(frags[f])] for r in range(world)]
                    for j, i in enumerate(frags[f]):
                        mean = sum(d[j] for d in deltas) / world
                        if outers[f] is None:
                            anchors[f][j].sub_(mean)
                        else:
                            anchors[f][j].grad = mean.clone()
                    if outers[f] is not None:
                        outers[f].step()
                    for j, i in enumerate(frags[f]):
                        a = anchors[f][j]
                        for r in range(world):
                            plist[r][i].copy_(a + alpha * (plist[r][i] - a) if tau else a)
                if tau and (t + tau) >= period and (t + tau) % period == 0:
                    f = ((t + tau) // period - 1) % n_frag
                    pending[f] = [[anchors[f][j] - plist[r][i] for j, i in enumerate(frags[f])] for r in range(world)]
        out.append([[p.detach().clone().numpy() for p in ps] for ps in plist])
    return out


# ---------------------------------------------------------------------- rank functions


def _run_case(role: Any, cfg: dict[str, Any], steps: int, ckpt: str | None = None) -> dict[str, Any]:
    from fleetlike import Executor, fleet

    trace, infos = [], []
    with fleet.session(role):
        start = 0
        if cfg.get("style") == "eager":
            model = fleet.distributed_model(make_model(role.rank))  # broadcasts rank 0's parameters
            opt = fleet.distributed_optimizer(inner_optimizer(model, cfg.get("inner", "sgd")), strategy(cfg))
            if cfg.get("resume_at"):
                fleet.load_persistables(None, f"{ckpt}/{role.rank}")
                start = cfg["resume_at"]
            for step in range(start, steps):
                opt.zero_grad()
                loss = loss_fn(model, batch(step, role.rank))
                loss.backward()
                opt.step(loss=loss)
                if cfg.get("barrier"):  # a main-thread collective while a fragment is in flight
                    fleet.barrier_worker()
                infos.append({k: opt.step_info[k] for k in ("localsgd_averaged", "bytes_communicated")})
                trace.append([p.detach().clone().numpy() for p in model.module.parameters()])
                if cfg.get("save_at") == step + 1:
                    fleet.save_persistables(None, f"{ckpt}/{role.rank}")
            text = ""
        else:
            model = make_model(role.rank)
            opt = inner_optimizer(model, cfg.get("inner", "sgd"))
            fleet.distributed_optimizer(opt, strategy(cfg)).minimize(loss_fn, model)
            exe = Executor()
            exe.run(fleet.startup_program)
            names = ["localsgd_averaged", "bytes_communicated"]
            for step in range(steps):
                values = exe.run(fleet.main_program, feed=batch(step, role.rank), fetch_list=names)
                infos.append(dict(zip(names, values)))
                trace.append([p.detach().clone().numpy() for p in model.parameters()])
            text = str(fleet.main_program)
        applied = [str(e) for e in fleet.applied_strategy()]
    return {"trace": trace, "infos": infos, "program": text, "applied": applied}


def _cases(role: Any, cases: list[dict[str, Any]], steps: int, ckpt: str | None = None) -> list[dict[str, Any]]:
    return [_run_case(role, cfg, steps, ckpt) for cfg in cases]


def _check_against_reference(results: list[list[dict[str, Any]]], cases: list[dict[str, Any]], world: int,
                             steps: int, tol: float = TOL) -> None:
    for c, cfg in enumerate(cases):
        ref = simulate(cfg, world, steps)
        for rank in range(world):
            trace = results[rank][c]["trace"]
            for step in range(steps):
                diff = max_diff(trace[step], ref[step][rank])
                assert diff < tol, f"case {cfg} rank {rank} step {step + 1}: {diff:.3g} from the simulation"


# ---------------------------------------------------------------------- tests


def test_split_fragments_is_consecutive_balanced_and_whole() -> None:
    params = list(make_model(0).parameters())

    class _Never:
        def start_tensor(self, tensor: torch.Tensor, index: int) -> Any:
            raise AssertionError("not started in this test")

    frags = split_fragments(params, 2, _Never(), None)
    index = {id(p): i for i, p in enumerate(params)}
    assert [[index[id(p)] for p in f.params] for f in frags] == HALVES
    for count in (1, 3, 4, 8, 12):
        parts = [[index[id(p)] for p in f.params] for f in split_fragments(params, count, _Never(), None)]
        assert sum(parts, []) == list(range(len(params)))  # consecutive, nothing lost or repeated
        assert len(parts) == count
    with pytest.raises(ValueError, match="fragments=0"):
        split_fragments(params, 0, _Never(), None)


def test_outer_rule_is_torch_sgd() -> None:
    """The in-place outer step equals torch.optim.SGD on the same pseudo-gradients, bit for bit."""
    torch.manual_seed(3)
    for kind, mu in [("sgd", 0.0), ("sgd", 0.8), ("nesterov", 0.9)]:
        anchor = torch.randn(17)
        ref = torch.nn.Parameter(anchor.clone())
        opt = torch.optim.SGD([ref], lr=0.7, momentum=mu, nesterov=kind == "nesterov")
        rule, buf = OuterRule(kind, 0.7, mu), None
        for _ in range(5):
            g = torch.randn(17)
            buf = rule.apply_(anchor, g, buf)
            ref.grad = g.clone()
            opt.step()
            assert torch.equal(anchor, ref.detach()), kind
    with pytest.raises(ValueError, match="nesterov"):
        OuterRule("nesterov", 0.7, 0.0)


def test_syncs_reuse_one_buffer_and_keep_the_fresh_tensor_arithmetic() -> None:
    """Every sync writes its delta into the same persistent buffer (no model-size allocation
    per sync), and the values are bit for bit those of the fresh tensors the formulas name:
    ``delta = anchor - flat(params)``; with overlap, ``anchor + alpha * (flat - anchor)``."""

    class _Keep:  # a world of one: the "average" leaves the delta as it is
        def __init__(self) -> None:
            self.seen: list[tuple[int, torch.Tensor]] = []

        def start_tensor(self, tensor: torch.Tensor, index: int) -> Any:
            self.seen.append((tensor.data_ptr(), tensor.clone()))
            return CompletedWork(None)

    torch.manual_seed(5)
    model = make_model(0)
    params = list(model.parameters())
    keep = _Keep()
    (frag,) = split_fragments(params, 1, keep, None)
    frag.snapshot()
    rule, alpha = OuterRule("nesterov", 0.7, 0.9), 0.5
    ref_anchor = [a.clone() for a in frag.anchors]
    ref_buf: list[torch.Tensor | None] = [None] * len(ref_anchor)
    for sync in range(3):
        with torch.no_grad():
            for p in params:  # local steps moved the parameters
                p.add_(torch.randn_like(p), alpha=0.1)
        flat = [torch.cat([p.detach().reshape(-1) for p in g]) for g in frag.groups]
        frag.launch()
        deltas = [a - f for a, f in zip(ref_anchor, flat)]
        for (ptr, sent), d, buf in zip(keep.seen[-len(deltas):], deltas, frag.scratch):
            assert ptr == buf.data_ptr()
            assert torch.equal(sent, d)
        frag.land(rule, alpha, overlapped=True)
        for i, d in enumerate(deltas):
            ref_buf[i] = rule.apply_(ref_anchor[i], d, ref_buf[i])
            expect = ref_anchor[i] + alpha * (flat[i] - ref_anchor[i])
            assert torch.equal(frag.anchors[i], ref_anchor[i])
            assert torch.equal(torch.cat([p.detach().reshape(-1) for p in frag.groups[i]]), expect), sync
    assert len({ptr for ptr, _ in keep.seen}) == len(frag.groups)  # one buffer each, every sync


CASES_2 = [
    # outer "sgd" lr 1 without momentum is the plain average: equal to Paddle's local SGD
    {"k": 3, "begin": 2, "outer_optimizer": "sgd", "outer_lr": 1.0, "outer_momentum": 0.0},
    {"k": 3, "begin": 2, "outer_optimizer": "nesterov", "style": "eager"},
    {"k": 4, "outer_optimizer": "nesterov", "inner": "adam"},
    {"k": 4, "outer_optimizer": "nesterov", "fragments": 2, "parts": HALVES, "style": "eager"},
    {"k": 4, "outer_optimizer": "nesterov", "fragments": 2, "overlap": 1, "overlap_alpha": 0.5, "parts": HALVES},
    {"k": 6, "outer_optimizer": "sgd", "outer_momentum": 0.5, "fragments": 2, "overlap": 2, "overlap_alpha": 0.0,
     "parts": HALVES, "style": "eager", "rings": 2, "barrier": True},
    {"k": 2, "adaptive": True, "outer_optimizer": "nesterov", "style": "eager"},
]


@pytest.mark.timeout(180)
def test_diloco_equals_the_simulation_in_both_styles() -> None:
    steps = 13
    results = run_ranks(_cases, 2, CASES_2, steps, timeout=150)
    # the adaptive schedule is checked against its own formula in test_localsgd: here only that it runs
    fixed = [c for c in CASES_2 if not c.get("adaptive")]
    idx = [i for i, c in enumerate(CASES_2) if not c.get("adaptive")]
    _check_against_reference([[r[i] for i in idx] for r in results], fixed, 2, steps)
    program = results[0][4]["program"]
    assert "outer=nesterov(lr=0.7, momentum=0.9)" in program and "fragments=2" in program
    assert "c_allreduce_avg_pseudograd" in program and "fragment=1" in program
    applied = " ".join(results[0][4]["applied"])
    assert "nesterov outer step" in applied and "2 fragments synced 2 steps apart" in applied
    # each fragment's sync sends its own bytes only: the two halves, never the whole model
    sizes = {sum(p.numel() for i, p in enumerate(make_model(0).parameters()) if i in part) * 4 for part in HALVES}
    sent = {i["bytes_communicated"] for i in results[0][3]["infos"][1:]} - {0}
    assert sent == sizes
    adaptive = results[0][6]
    assert adaptive["infos"][0]["localsgd_averaged"] and "nesterov" in " ".join(adaptive["applied"])


def _resume(role: Any, ckpt: str) -> list[dict[str, Any]]:
    cfg = {"k": 4, "outer_optimizer": "nesterov", "fragments": 2, "overlap": 1, "parts": HALVES, "style": "eager"}
    whole = _run_case(role, cfg, 12)
    first = _run_case(role, {**cfg, "save_at": 7}, 7, ckpt)  # step 7 launched fragment 1 (lands at 8)
    second = _run_case(role, {**cfg, "resume_at": 7}, 12, ckpt)
    return [whole, first, second]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_resume_with_a_fragment_in_flight_is_exact() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_resume, 2, tmp, timeout=100)
    for rank in range(2):
        whole, _, second = results[rank]
        for step in range(7, 12):
            assert max_diff(whole["trace"][step], second["trace"][step - 7]) == 0.0, (rank, step)


CASES_4 = [
    {"k": 4, "outer_optimizer": "nesterov", "fragments": 2, "overlap": 1, "parts": HALVES, "hier": True},
    {"k": 4, "outer_optimizer": "nesterov", "hier": True, "style": "eager"},
    {"k": 4, "outer_optimizer": "nesterov", "sync_dtype": "bfloat16", "style": "eager"},
    # compressed syncs run on a worker thread while the loop's barriers run on the main thread
    # (on a shared communicator this deadlocked)
    {"k": 4, "outer_optimizer": "nesterov", "fragments": 2, "overlap": 1, "parts": HALVES, "sync_dtype": "bfloat16",
     "style": "eager", "barrier": True},
]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_hierarchical_and_compressed_pseudo_gradients_on_two_nodes() -> None:
    steps = 9
    results = run_ranks(_cases, 4, CASES_4, steps, nodes=2, timeout=150)
    _check_against_reference([r[:2] for r in results], CASES_4[:2], 4, steps, tol=1e-5)
    assert any(a.startswith("use_hierarchical_allreduce: applied") for a in results[0][0]["applied"])
    # bfloat16 on the wire: half the bytes, and close to the float32 simulation (the codec's error)
    numel = sum(p.numel() for p in make_model(0).parameters())
    synced = [i for i in results[0][2]["infos"] if i["localsgd_averaged"]]
    assert {i["bytes_communicated"] for i in synced[1:]} == {numel * 2}
    ref = simulate(CASES_4[2], 4, steps)
    diff = max(max_diff(results[r][2]["trace"][-1], ref[-1][r]) for r in range(4))
    assert 0 < diff < 2e-2, diff
    assert any(a.startswith("localsgd_configs.sync_dtype: applied") and "bfloat16" in a for a in results[0][2]["applied"])
    ref = simulate(CASES_4[3], 4, steps)
    diff = max(max_diff(results[r][3]["trace"][-1], ref[-1][r]) for r in range(4))
    assert 0 < diff < 2e-2, diff


def test_bad_settings_are_refused_with_the_fix() -> None:
    s = DistributedStrategy(localsgd=True)
    with pytest.raises(ValueError, match=r"fragments=3 must divide localsgd_configs.k_steps=4"):
        s.localsgd_configs = {"k_steps": 4, "fragments": 3}
    with pytest.raises(ValueError, match=r"overlap=2 must be below k_steps/fragments=2"):
        s.localsgd_configs = {"k_steps": 4, "fragments": 2, "overlap": 2}
    with pytest.raises(ValueError, match="outer_momentum=0.0 must be > 0 with outer_optimizer='nesterov'"):
        s.localsgd_configs = {"outer_optimizer": "nesterov", "outer_momentum": 0}
    with pytest.raises(ValueError, match="did you mean 'nesterov'"):
        s.localsgd_configs = {"outer_optimizer": "nestrov"}
    with pytest.raises(ValueError, match="overlap_alpha=1.5 must be in"):
        s.localsgd_configs = {"overlap_alpha": 1.5}
    assert s.localsgd_configs["k_steps"] == 1 and s.localsgd_configs["fragments"] == 1  # nothing lost
    s.localsgd_configs = {"k_steps": 8, "fragments": 4, "overlap": 1}  # both keys in one assignment
    s.fp16_allreduce = True
    with pytest.raises(ValueError, match="sync_dtype"):
        s.validate_combination()

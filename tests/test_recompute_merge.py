"""Recompute changes memory, never gradients; gradient merge k x b equals data parallel with k*b."""

from __future__ import annotations

import pytest
import torch

from dp_common import batch, loss_fn, make_model, make_opt, max_diff, params
from fleetlike import DistributedStrategy, Executor, fleet
from fleetlike.roles import UserDefinedRoleMaker
from fleetlike.strategies.recompute import apply_recompute, auto_checkpoints
from fleetlike.testing import run_ranks


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(width, 4 * width)
        self.fc2 = torch.nn.Linear(4 * width, width)
        self.drop = torch.nn.Dropout(0.2)

    def forward(self, x):
        return x + self.drop(self.fc2(torch.relu(self.fc1(x))))


class Stack(torch.nn.Module):
    def __init__(self, blocks: int = 8, width: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def saved_bytes(model, x) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x).sum()
    out.backward()
    return total


def _one_step(recompute_names, seed=3):
    model = Stack()
    if recompute_names:
        apply_recompute(model, recompute_names)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(seed)
    x = torch.randn(16, 32)
    model(x).pow(2).mean().backward()
    opt.step()
    return params(model)


def test_recompute_gives_identical_parameters_with_dropout():
    base = _one_step([])
    for names in (auto_checkpoints(Stack()), ["blocks.0", "blocks.3", "blocks.7"]):
        assert max_diff(_one_step(names), base) <= 1e-6


def test_recompute_saves_at_most_40_percent_of_activation_bytes():
    x = torch.randn(64, 32)
    baseline = saved_bytes(Stack(), x)
    model = Stack()
    apply_recompute(model, auto_checkpoints(model))
    assert saved_bytes(model, x) <= 0.4 * baseline


def test_recompute_names_are_checked():
    with pytest.raises(ValueError, match=r"'blocks\.9'.*close matches: 'blocks\.7'"):
        apply_recompute(Stack(), ["blocks.9"])
    assert auto_checkpoints(Stack()) == [f"blocks.{i}" for i in range(8)]
    with pytest.raises(ValueError, match="no repeated blocks"):
        auto_checkpoints(torch.nn.Linear(2, 2))


def _recompute_run(recompute: bool, style: str) -> tuple[list, list[str], str | None]:
    """Three steps of the Stack (dropout on) on a world of one, through the strategy."""
    model = Stack()
    s = DistributedStrategy()
    s.recompute = recompute
    s.recompute_configs = {"checkpoints": "auto"}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def lf(m, x):
        return m(x).pow(2).mean()

    torch.manual_seed(3)  # the dropout masks: a recomputed forward must draw the same
    with fleet.session(UserDefinedRoleMaker(0, ["127.0.0.1:6170"])):  # one rank: no port is bound
        if style == "program":
            fleet.distributed_optimizer(opt, s).minimize(lf, model)
            for step in range(3):
                Executor().run(fleet.main_program, feed=torch.randn(4, 32))
            listing = str(fleet.main_program)
        else:
            wrapped = fleet.distributed_model(model)
            dopt = fleet.distributed_optimizer(opt, s)
            for step in range(3):
                dopt.zero_grad()
                lf(wrapped, torch.randn(4, 32)).backward()
                dopt.step()
            listing = None
        applied = [str(e) for e in fleet.applied_strategy()]
    return params(model), applied, listing


@pytest.mark.parametrize("style", ["program", "eager"])
def test_recompute_through_the_strategy_changes_nothing_but_memory(style):
    plain, _, _ = _recompute_run(False, style)
    got, applied, listing = _recompute_run(True, style)
    assert max_diff(got, plain) <= 1e-6
    assert any(a.startswith("recompute: applied") for a in applied), applied
    if style == "program":
        assert "recompute=8 segments" in listing


def _merge(role, k, opt_name, extra):
    """12 updates of batch b*k per rank, in both styles: one big batch per update (k == 1), or
    k micro-batches of b with gradient merge (the eager loop calls step() on every one)."""
    s = DistributedStrategy()
    for key, value in extra.items():
        setattr(s, key, value)
    if k > 1:
        s.gradient_merge = True
        s.gradient_merge_configs = {"k_steps": k, "avg": True}
    out = {}
    for style in ("program", "eager"):
        with fleet.session(role, timeout=30):
            model = make_model(100 + role.rank)
            if style == "program":
                fleet.distributed_optimizer(make_opt(opt_name, model), s).minimize(loss_fn, model)
                exe = Executor()
                exe.run(fleet.startup_program)

                def run(feed, exe=exe):
                    exe.run(fleet.main_program, feed=feed)
            else:
                wrapped = fleet.distributed_model(model)
                opt = fleet.distributed_optimizer(make_opt(opt_name, model), s)

                def run(feed, wrapped=wrapped, opt=opt):
                    opt.zero_grad()  # kept inside the merge window
                    loss_fn(wrapped, feed).backward()
                    opt.step()  # updates on the k-th micro-batch only
            world = fleet._ctx.world
            for step in range(12):
                big = batch(step, role.rank * 100 + 7)
                b = len(big["x"]) // k
                for micro in range(k):  # k micro-batches of b: rows micro*b .. of the big batch
                    run({n: t[micro * b:(micro + 1) * b] for n, t in big.items()})
            out[style] = params(model), world.stats.total_calls
    return out


#: (label, k, strategy settings): 4 micro-batches merged, the 4x bigger batch, merged under bf16 AMP
MERGE_RUNS = (("merged", 4, {}), ("plain", 1, {}), ("amp", 4, {"amp": True, "amp_configs": {"dtype": "bfloat16"}}))


def _merge_runs(role, opt_names):
    """Every (optimizer, run) of `MERGE_RUNS` in turn in the same ranks: one job, each run in its
    own sessions as separate jobs would be."""
    return {(opt_name, label): _merge(role, k, opt_name, extra)
            for opt_name in opt_names for label, k, extra in MERGE_RUNS}


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_gradient_merge_equals_bigger_batch_with_a_quarter_of_the_collectives():
    ranks = run_ranks(_merge_runs, 2, ("sgd", "momentum"), timeout=130)
    for opt_name in ("sgd", "momentum"):
        merged, plain, amp = ([r[(opt_name, label)] for r in ranks] for label, _, _ in MERGE_RUNS)
        for style in ("program", "eager"):
            for m, p in zip(merged, plain):
                (pm, calls_m), (pp, calls_p) = m[style], p[style]
                assert max_diff(pm, pp) <= 1e-6, (opt_name, style)
                assert calls_m == calls_p, (opt_name, style)  # one bucket per update; 4x the micro-steps
            assert max_diff(merged[0][style][0], merged[0]["program"][0]) <= 1e-6, (opt_name, style)
        # with AMP (bf16, no scaling) and recompute-free composition: still merges and agrees across ranks
        for style in ("program", "eager"):
            assert max_diff(amp[0][style][0], amp[1][style][0]) == 0.0, (opt_name, style)
            assert max_diff(amp[0][style][0], merged[0][style][0]) <= 5e-2, (opt_name, style)


def _merge_ckpt(role, ckpt, phase):
    with fleet.session(role, timeout=30):
        model = make_model(100 + role.rank)
        s = DistributedStrategy()
        s.gradient_merge = True
        s.gradient_merge_configs = {"k_steps": 3, "avg": True}
        fleet.distributed_optimizer(make_opt("momentum", model), s).minimize(loss_fn, model)
        exe = Executor()
        exe.run(fleet.startup_program)
        mine = f"{ckpt}/{fleet.worker_index()}"  # seed 003's per-rank pattern: partial sums are rank-local
        steps = range(10)
        if phase == "resume":
            fleet.load_persistables(exe, mine)
            steps = range(5, 10)  # 5 % 3 == 2: two micro-steps of partial sums pending
        if phase == "wrong_rank":
            try:
                fleet.load_persistables(exe, f"{ckpt}/0")
            except ValueError as exc:
                return "rank-local" in str(exc) or "partial sums are rank" in str(exc)
            return role.rank == 0  # rank 0 loading its own checkpoint is fine
        for step in steps:
            if phase == "full" and step == 5:
                fleet.save_persistables(exe, mine)
            exe.run(fleet.main_program, feed=batch(step, role.rank))
        return params(model)


def _merge_ckpt_phases(role, ckpt, phases):
    return [_merge_ckpt(role, ckpt, phase) for phase in phases]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_gradient_merge_partial_sums_survive_save_load(tmp_path):
    ckpt = str(tmp_path / "ck")
    full = run_ranks(_merge_ckpt, 2, ckpt, "full", timeout=45)
    # fresh ranks resume from the checkpoint, then (in a session of their own) try another rank's
    resumed, refused = zip(*run_ranks(_merge_ckpt_phases, 2, ckpt, ("resume", "wrong_rank"), timeout=60))
    for a, b in zip(full, resumed):
        assert max_diff(a, b) == 0.0
    # another rank's mid-window partial sums are refused, not silently used
    assert list(refused) == [True, True]

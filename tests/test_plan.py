"""The strategy planner (fleetlike.plan): its collective list is what the programs issue, its memory
is what ranks hold, its inputs fail clearly.

- every candidate of the search space (2 nodes x 2 ranks), traced in one process, issues per
  period exactly the calls and bytes (per op and communicator) that ``comm.stats`` counts on
  four real gloo ranks running the same strategy's ``fleet.main_program``;
- the predicted peak memory per rank is within 10% of the tensor bytes a real rank holds (every
  live tensor found by ``gc`` after the forward plus what autograd saved, or after backward);
- bad ``--allow``, ``--model``, ``--cluster`` and ``--links`` get errors naming the fix;
- the cost model's pieces: the probe's fit recovers alpha and beta, a pipelined bucket costs
  between its busiest kind and the plain sum, ``annotate`` prints a time per collective, a
  16-bit reduction (same dtype as the real ranks put on the wire) reads its own probed ladder;
- the probe itself on four real ranks of two loopback nodes: every group kind, op and 16-bit
  reduction gets a ladder, and rank 0 alone returns the figures.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import mmap
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from fleetlike import Executor, fleet
from fleetlike.plan import Cluster, Links, ModelSpec, candidates, trace
from fleetlike.plan.cli import main as plan_main
from fleetlike.plan.cost import _bucket_cost, event_cost, step_time
from fleetlike.plan.dry import Event
from fleetlike.plan.memory import storage_key
from fleetlike.plan.planner import annotate
from fleetlike.plan.probe import fit
from fleetlike.plan.spec import OptimizerKind
from fleetlike.plan.trace import first_touch_seconds
from fleetlike.program import StepState
from fleetlike.testing import run_ranks
from helpers import side_by_side

CLUSTER = Cluster(2, 2)
BATCH = 192
MEMORY_NAMES = ["dp", "fp16", "sharding", "localsgd", "gossip", "dp+recompute", "dp+amp"]


def build(batch_size: int):
    """A 2.6 MB MLP whose activations at this batch are about a third of its parameters."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(128, 1024), torch.nn.ReLU()),
                                torch.nn.Sequential(torch.nn.Linear(1024, 512), torch.nn.ReLU()),
                                torch.nn.Sequential(torch.nn.Linear(512, 10)))
    g = torch.Generator().manual_seed(5)
    feed = {"x": torch.randn(batch_size, 128, generator=g), "y": torch.randint(0, 10, (batch_size,), generator=g)}
    return model, lambda m, f: F.cross_entropy(m(f["x"]), f["y"]), feed


def _spec() -> ModelSpec:
    return ModelSpec(build, BATCH, OptimizerKind.MOMENTUM.factory(0.01))


def _per_comm(events) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for e in events:
        c = out.setdefault(f"{e.op}@{e.comm}", [0, 0])
        c[0] += 1
        c[1] += e.nbytes
    return out


def _comms(groups) -> list:
    found = [groups.world, *groups._rings[1:], groups._intra, groups._inter, *groups._extra.values()]
    unique = {id(c): c for c in found if c is not None}
    return list(unique.values())


def _live() -> dict[tuple[int, int], int]:
    with warnings.catch_warnings():  # isinstance() on torch's deprecated module attributes warns
        warnings.simplefilter("ignore")
        found = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    return {storage_key(o): o.untyped_storage().nbytes() for o in found if o.untyped_storage().nbytes() > 0}


def _measure_step(main, feed, base, model, measure: bool = True) -> int | None:
    """Tensor bytes this rank holds at the end of the forward (live + saved) or after backward
    (live + the gradients autograd made, which have no Python object until read). Without
    ``measure``, the step only runs (its collectives pair with the measuring rank's), without
    the scans of every live object, which cost far more than the step."""
    st_ = StepState(feed=feed)
    if not measure:
        for op in main.ops:
            if op.fn is not None:
                op.fn(st_)
        return None
    peak = 0
    for op in main.ops:
        if op.fn is None:
            continue
        if op.type == "forward":
            saved: dict[tuple[int, int], int] = {}

            def pack(t):
                saved[storage_key(t)] = t.untyped_storage().nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                op.fn(st_)
            gc.collect()
            live = {k: v for k, v in _live().items() if k not in base}
            peak = max(peak, sum(live.values()) + sum(v for k, v in saved.items() if k not in live and k not in base))
        else:
            op.fn(st_)
        if op.type == "backward":
            gc.collect()
            live = _live()
            live.update({storage_key(p.grad): p.grad.untyped_storage().nbytes() for p in model.parameters()
                         if p.grad is not None})
            peak = max(peak, sum(v for k, v in live.items() if k not in base))
    return peak


def _issued(role, plan: dict) -> dict:
    torch.set_num_threads(1)
    out: dict = {}
    with fleet.session(role, timeout=120):
        groups = fleet.context().groups
        for name, (options, warm, period) in plan.items():
            measure = role.rank == 0 and name in MEMORY_NAMES  # (what the test compares)
            if measure:
                gc.collect()
            base = set(_live()) if measure else set()
            model, loss_fn, feed = build(BATCH)
            opt = OptimizerKind.MOMENTUM.factory(0.01)(model)
            from fleetlike import DistributedStrategy

            fleet.distributed_optimizer(opt, DistributedStrategy.from_dict(options)).minimize(loss_fn, model)
            Executor().run(fleet.startup_program)
            for _ in range(warm):
                fleet.main_program.run(feed)
            dtypes: dict[str, int] = {}
            for c in _comms(groups):
                c.stats.reset()
                c._record = _counting_dtypes(c, dtypes)
            for _ in range(period):
                fleet.main_program.run(feed)
            for c in _comms(groups):
                del c._record
            stats: dict[str, list[int]] = {}
            for c in _comms(groups):
                snap = c.stats.snapshot()
                for op, calls in snap["calls"].items():
                    s = stats.setdefault(f"{op}@{c.name}", [0, 0])
                    s[0] += calls
                    s[1] += snap["bytes"][op]
            # the other ranks only step (their collectives pair with rank 0's)
            peak = (_measure_step(fleet.main_program, feed, base, model, measure=measure)
                    if name in MEMORY_NAMES else None)
            out[name] = {"stats": stats, "peak": peak, "dtypes": dtypes}
    return out


def _counting_dtypes(comm, into: dict[str, int]):
    """``comm._record`` that also counts each call's wire dtype (``op@comm:dtype``)."""
    record = comm._record

    def counted(op: str, nbytes: int, dtype=None) -> None:
        key = f"{op}@{comm.name}:{str(dtype).replace('torch.', '')}"
        into[key] = into.get(key, 0) + 1
        record(op, nbytes, dtype)

    return counted


def _per_dtype(events) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in events:
        key = f"{e.op}@{e.comm}:{e.dtype}"
        out[key] = out.get(key, 0) + 1
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_collective_lists_and_memory_match_real_ranks():
    from fleetlike.plan.trace import period_of

    cands = candidates("basic", CLUSTER)
    assert len(cands) >= 12
    plan = {c.name: (dict(c.options), *period_of(c.strategy())) for c in cands}
    # the traces (this process) while the real ranks run (`helpers.side_by_side`): the ranks
    # wait on each other's collectives, and the tracing fills those waits
    with side_by_side({"ranks": functools.partial(run_ranks, _issued, CLUSTER.world_size, plan, nodes=CLUSTER.nodes,
                                                  timeout=280),
                       "traces": lambda: {c.name: trace(_spec(), c.strategy(), CLUSTER, repeats=1) for c in cands}}) as jobs:
        pass
    ranks, traces = jobs["ranks"].result(), jobs["traces"].result()
    for name, t in traces.items():
        expected = _per_comm(t.events())
        assert expected, name
        got = ranks[0][name]["stats"]
        got = {k: v for k, v in got.items() if v[0]}
        assert got == expected, (name, got, expected)
        # and in the dtypes they carry (a 16-bit reduction is priced from its own ladder)
        assert ranks[0][name]["dtypes"] == _per_dtype(t.events()), name
        by_op: dict[str, list[int]] = {}
        for k, (calls, nbytes) in expected.items():
            s = by_op.setdefault(k.split("@")[0], [0, 0])
            s[0] += calls
            s[1] += nbytes
        for r in ranks[1:]:  # every rank issues the same calls and bytes (other group names)
            theirs: dict[str, list[int]] = {}
            for k, (calls, nbytes) in r[name]["stats"].items():
                s = theirs.setdefault(k.split("@")[0], [0, 0])
                s[0] += calls
                s[1] += nbytes
            assert {k: v for k, v in theirs.items() if v[0]} == by_op, name
    assert any(k.endswith(":float16") for k in ranks[0]["fp16"]["dtypes"])
    # the communication choices really differ on the wire (recompute and AMP do not change it)
    assert len({json.dumps(_per_comm(t.events()), sort_keys=True) for t in traces.values()}) >= 7
    for name in MEMORY_NAMES:
        predicted, measured = traces[name].memory.peak, ranks[0][name]["peak"]
        assert abs(predicted - measured) <= 0.10 * measured, (name, predicted, measured, traces[name].memory)
    mem = {n: traces[n].memory for n in MEMORY_NAMES}
    # recompute keeps only the blocks' inputs; in this MLP those are what a plain forward keeps too
    # (each ReLU's output is the next Linear's saved input), so it saves nothing here, and the
    # planner says so instead of assuming a gain
    assert mem["dp+recompute"].activations <= mem["dp"].activations
    assert mem["localsgd"].strategy_state >= mem["dp"].params * 0.9  # the anchors


def test_bad_inputs_get_clear_errors(capsys, tmp_path):
    base = ["--model", "test_plan:build", "--cluster", "2x2", "--intra", "50,1000", "--inter", "100,100"]
    assert plan_main([*base, "--allow", "localsgd,powersgd"]) == 2
    err = capsys.readouterr().err
    assert "--allow='powersgd'" in err and "'localsgd'" in err and "'gossip'" in err and "'gradient_merge'" in err
    assert plan_main([*base[:1], "no_such_module_xyz:build", *base[2:]]) == 2
    err = capsys.readouterr().err
    assert "cannot import module 'no_such_module_xyz'" in err and "PYTHONPATH" in err
    assert plan_main([*base[:1], "test_plan:nope", *base[2:]]) == 2
    assert "has no function 'nope'" in capsys.readouterr().err
    assert plan_main([*base[:1], "test_plan", *base[2:]]) == 2
    assert "write module:function" in capsys.readouterr().err
    for bad in ("2by2", "2x0", "x2", "2x2x2"):
        assert plan_main([*base[:2], "--cluster", bad, *base[4:]]) == 2
        assert f"cluster {bad!r} does not parse" in capsys.readouterr().err
    assert plan_main([*base[:4], "--links", str(tmp_path / "none.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text('{"fits": 3}')
    assert plan_main([*base[:4], "--links", str(tmp_path / "bad.json")]) == 2
    assert "not a link-figures file" in capsys.readouterr().err
    assert plan_main([*base, "--memory", "lots"]) == 2
    assert "--memory 'lots' does not parse" in capsys.readouterr().err
    assert plan_main([*base, "--optimizer", "lamb"]) == 2
    err = capsys.readouterr().err
    assert "optimizer='lamb'" in err and "'adamw'" in err
    assert plan_main([*base, "--compute_seconds", "-0.5"]) == 2
    assert "--compute_seconds -0.5 must be a positive number" in capsys.readouterr().err
    assert plan_main([*base, "--amp_compute_seconds", "0"]) == 2
    assert "--amp_compute_seconds 0.0 must be a positive number" in capsys.readouterr().err


def test_cli_table_recommendation_and_annotated_program(capsys, tmp_path):
    out = tmp_path / "s.json"
    args = ["--model", "test_plan:build", "--batch_size", "32", "--cluster", "2x2", "--intra", "50,1000",
            "--inter", "100,20", "--only", "dp,hier,fp16,localsgd", "--save", str(out), "--show",
            "--json", str(tmp_path / "t.json")]
    assert plan_main(args) == 0
    text = capsys.readouterr().out
    assert "localsgd" in text and "changes math (not allowed)" in text
    table = json.loads((tmp_path / "t.json").read_text())
    rows = {r["name"]: r for r in table["rows"]}
    rec = table["recommended"]
    assert rec != "localsgd" and rows[rec]["step_s"] == min(r["step_s"] for r in rows.values() if not r["changes_math"])
    assert rows["fp16"]["inter_bytes_per_step"] == pytest.approx(rows["dp"]["inter_bytes_per_step"] / 2, rel=0.01)
    from fleetlike import DistributedStrategy

    saved = DistributedStrategy.load(out)  # fleet reads it as is
    assert saved.to_dict(non_default_only=True) == DistributedStrategy.from_dict(rows[rec]["options"]).to_dict(non_default_only=True)
    assert "predicted=" in text and "ms/step" in text
    # with local SGD allowed and a slow link, local SGD (a quarter of the traffic) wins
    assert plan_main([*args[:-5], "--allow", "localsgd", "--json", str(tmp_path / "t2.json")]) == 0
    assert json.loads((tmp_path / "t2.json").read_text())["recommended"] == "localsgd"
    # a memory limit below every candidate: marked, nothing recommended
    assert plan_main([*args[:-5], "--memory", "1MiB"]) == 0
    text = capsys.readouterr().out
    assert "!mem" in text and "no recommendation: no candidate fits the memory limit" in text
    # the model's compute measured on the job: each trace scales by it (its own ratio, shown)
    assert plan_main([*args[:-5], "--compute_seconds", "0.05", "--json", str(tmp_path / "t3.json")]) == 0
    assert "(median over traces, from --compute_seconds)" in capsys.readouterr().out


@given(alpha=st.floats(1e-6, 1e-2), beta=st.floats(1e-10, 1e-7), noise=st.lists(st.floats(-0.02, 0.02), min_size=5, max_size=5))
def test_probe_fit_predicts_every_size(alpha, beta, noise):
    sizes = [4 << 10, 256 << 10, 1 << 20, 4 << 20, 8 << 20]
    pts = [(s, (alpha + beta * s) * (1 + e)) for s, e in zip(sizes, noise)]
    a, b = fit(pts)
    for s in sizes:  # the fitted line predicts every size within the noise
        assert a + b * s == pytest.approx(alpha + beta * s, rel=0.05)
    if beta * sizes[-1] > 10 * alpha:  # bandwidth-dominated: the slope itself is recovered
        assert b == pytest.approx(beta, rel=0.1)


@given(segs=st.integers(1, 12), intra=st.floats(1e-4, 1e-2), inter=st.floats(1e-4, 1e-2))
def test_pipelined_bucket_cost_between_busiest_kind_and_plain_sum(segs, intra, inter):
    links = Links({"intra": {"reduce_scatter": (intra, 0.0), "all_gather": (intra, 0.0)},
                   "inter": {"all_reduce": (inter, 0.0)}})
    ev = []
    for _ in range(segs):
        ev += [Event("reduce_scatter", 8, "intra", (0, 1), ()), Event("all_reduce", 8, "inter", (0, 2), ()),
               Event("all_gather", 8, "intra", (0, 1), ())]
    c = _bucket_cost(ev, CLUSTER, links)
    total = sum(event_cost(e, CLUSTER, links) for e in ev)
    assert max(2 * segs * intra, segs * inter) - 1e-12 <= c <= total + 1e-12
    if segs == 1:
        assert c == pytest.approx(total)



@given(segs=st.integers(1, 12), intra=st.floats(1e-4, 1e-2), inter=st.floats(1e-4, 1e-2),
       work=st.lists(st.floats(0.0, 1e-2), min_size=37, max_size=37), scale=st.floats(1.0, 3.0))
def test_bucket_work_runs_between_its_calls_on_one_thread(segs, intra, inter, work, scale):
    links = Links({"intra": {"reduce_scatter": (intra, 0.0), "all_gather": (intra, 0.0)},
                   "inter": {"all_reduce": (inter, 0.0)}, "world": {"all_reduce": (inter, 0.0)}})
    # a compressed bucket: the guard's max, the cast, the 16-bit sum, the division: all in a row
    flat = [Event("all_reduce", 8, "world", (0, 1, 2, 3), (), dtype="float64"),
            Event("all_reduce", 1 << 20, "world", (0, 1, 2, 3), (), dtype="float16")]
    w = tuple(work[:3])
    assert _bucket_cost(flat, CLUSTER, links, w, scale) == pytest.approx(2 * inter + sum(w) * scale)
    # a two-level bucket: each segment's work waits for its input, overlapping the other segments'
    ev = []
    for _ in range(segs):
        ev += [Event("reduce_scatter", 8, "intra", (0, 1), ()), Event("all_reduce", 8, "inter", (0, 2), ()),
               Event("all_gather", 8, "intra", (0, 1), ())]
    w = tuple(work[: len(ev) + 1])
    bare = _bucket_cost(ev, CLUSTER, links)
    c = _bucket_cost(ev, CLUSTER, links, w, scale)
    assert max(bare, sum(w) * scale) - 1e-12 <= c <= bare + sum(w) * scale + 1e-12
    if segs == 1:  # one segment: nothing to overlap
        assert c == pytest.approx(bare + sum(w) * scale)


def test_trace_records_each_buckets_work_on_a_clock_without_page_faults():
    cands = {c.name: c for c in candidates("basic", CLUSTER)}
    t = trace(_spec(), cands["fp16"].strategy(), CLUSTER, repeats=1)
    for b in t.steps[0].buckets:  # before each call and after the last: the scan, cast, division
        assert len(b.work) == len(b.events) + 1 and all(w >= 0 for w in b.work) and sum(b.work) > 0
    links = Links.from_rates(intra=(50e-6, 1e9), inter=(100e-6, 1e8), cluster=CLUSTER)
    with_work = step_time(t, links)
    for s in t.steps:
        for b in s.buckets:
            b.work = ()
    assert with_work.comm > step_time(t, links).comm
    # the fabric's clock leaves out this process's page faults at the given cost per page
    from fleetlike.plan.dry import DryFabric

    fabric = DryFabric(1)
    fabric.fault_seconds = 1.0  # a second per fault: any fault shows
    m = mmap.mmap(-1, 64 * mmap.PAGESIZE)
    try:
        t0 = fabric.now()
        torch.frombuffer(m, dtype=torch.uint8).fill_(1)  # 64 fresh pages faulted in
        assert fabric.now() - t0 < -60
    finally:
        m.close()


def test_trace_costs_and_annotates_hierarchical_segments():
    cand = {c.name: c for c in candidates("basic", CLUSTER)}["hier"]
    t = trace(_spec(), cand.strategy(), CLUSTER, repeats=1)
    kinds = {(e.op, e.comm) for e in t.events()}
    # two ranks per node: the node-local hops are broadcasts (`intra_form="broadcast"`)
    assert kinds == {("broadcast", "intra[node 0]"), ("all_reduce", "inter[local 0]")}
    nparam = sum(p.numel() for p in build(1)[0].parameters())
    sent = {op: sum(e.nbytes for e in t.events() if e.op == op) for op in ("broadcast", "all_reduce")}
    assert sent["broadcast"] == 2 * nparam * 4  # the halves exchanged, then the sums gathered
    assert sent["all_reduce"] >= nparam * 4 // 2  # this rank's half crosses the nodes
    links = Links.from_rates(intra=(50e-6, 1e9), inter=(100e-6, 1e8), cluster=CLUSTER)
    cost = step_time(t, links)
    assert cost.seconds > cost.compute > 0
    listing = str(annotate(t.program, t, links))
    assert "predicted=" in listing and "c_hierarchical_allreduce_avg" in listing
    assert np.isfinite(cost.inter_bytes) and cost.inter_bytes > 0


def test_trace_prices_the_first_touch_of_gradients_freed_every_step():
    """Local SGD has no gradient buckets: its clear_grad frees every gradient and each backward
    allocates them again, which a rank's own process pays in page faults (the planner's process
    reuses resident free memory, so its op times miss it: the localsgd row on the 50 MB
    MLP, 19-29% low). Data parallel's gradients are bucket views that stay: nothing to add."""
    cands = {c.name: c for c in candidates("basic", CLUSTER)}
    nbytes = sum(p.numel() * p.element_size() for p in build(1)[0].parameters())
    pages = -(-nbytes // mmap.PAGESIZE)
    page_s = first_touch_seconds()
    assert 0 < page_s < 1e-3
    ls = trace(_spec(), cands["localsgd"].strategy(), CLUSTER, repeats=1)
    assert [s.fresh_bytes for s in ls.steps] == [nbytes] * ls.period
    # what this process faulted itself is already in the op times: only the rest is added
    assert all(0.0 <= s.refault <= pages * page_s + 1e-12 for s in ls.steps)
    dp = trace(_spec(), cands["dp"].strategy(), CLUSTER, repeats=1)
    assert [(s.fresh_bytes, s.refault) for s in dp.steps] == [(0, 0.0)]
    # priced as compute, scaled with the op times
    links = dataclasses.replace(Links.from_rates(intra=(50e-6, 1e9), inter=(100e-6, 1e8), cluster=CLUSTER),
                                compute_scale=2.0)
    none = dataclasses.replace(ls, steps=[dataclasses.replace(s, refault=0.0) for s in ls.steps])
    full = dataclasses.replace(ls, steps=[dataclasses.replace(s, refault=pages * page_s) for s in ls.steps])
    added = step_time(full, links).compute - step_time(none, links).compute
    assert added == pytest.approx(2.0 * pages * page_s)
    assert step_time(full, links).seconds - step_time(none, links).seconds == pytest.approx(added)


def _gather_events(g, ranks=(0, 1, 2, 3)):
    return [Event("broadcast", n, "world", ranks, (), root=owner) for _, chunks in g.buckets
            for owner, pieces in chunks for n in pieces]


def test_gather_cost_schedules_the_interleaved_update_by_hand():
    from fleetlike.plan.cost import gather_cost
    from fleetlike.plan.trace import GatherTrace

    cluster = Cluster(2, 1)  # two ranks, one per node: the gather runs on the world
    links = Links({"world": {"broadcast": (0.0, 1e-4), "broadcast@1": (0.0, 2e-4)}})
    g_, s0 = 0.001, 0.010  # local work before each broadcast; rank 0's step of its 100 bytes
    g = GatherTrace("optimizer_update", True, 1 << 20, [(200, [(0, [100]), (1, [100])])], [g_, g_], 0.0, [s0, 0.0])
    ev = _gather_events(g, (0, 1))
    # rank 0 steps (s0), broadcasts 100 B at 1e-4 s/B; rank 1 steps its 100 B at rank 0's rate,
    # then broadcasts from root 1 (its own figures, 2e-4 s/B) once the link is free
    first_end = g_ + s0 + 0.01
    expected = max(first_end, 2 * g_ + s0) + 0.02
    seconds, net = gather_cost(g, ev, cluster, links)
    assert seconds == pytest.approx(expected) and net == pytest.approx(0.03)
    # the update run whole before the gather: no steps here, the broadcasts queue after the work
    whole = dataclasses.replace(g, interleaved=False, steps=[0.0, 0.0])
    assert gather_cost(whole, ev, cluster, links)[0] == pytest.approx(g_ + 0.01 + 0.02)
    # a window smaller than two buckets: every rank waits for the first bucket's broadcast
    # before the second bucket's work starts
    two = GatherTrace("optimizer_update", True, 150, [(100, [(0, [100])]), (100, [(1, [100])])], [g_, g_], 0.0,
                      [s0, 0.0])
    assert gather_cost(two, ev, cluster, links)[0] == pytest.approx(first_end + g_ + s0 + 0.02)


@given(layout=st.lists(st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(1, 4096), min_size=1, max_size=3)),
                                min_size=1, max_size=5), min_size=1, max_size=4),
       beta=st.floats(1e-9, 1e-5), step=st.floats(0.0, 1e-5), gap=st.floats(0.0, 1e-3), window=st.integers(1, 1 << 15))
def test_gather_cost_between_its_busiest_resource_and_everything_serial(layout, beta, step, gap, window):
    from fleetlike.plan.cost import gather_cost
    from fleetlike.plan.trace import GatherTrace

    buckets = [(sum(sum(p) for _, p in chunks), chunks) for chunks in layout]
    n = sum(len(p) for chunks in layout for _, p in chunks)
    steps: list[float] = []
    for chunks in layout:
        for owner, pieces in chunks:
            steps += [step * sum(pieces) if owner == 0 else 0.0] + [0.0] * (len(pieces) - 1)
    g = GatherTrace("optimizer_update", True, window, buckets, [gap] * n, gap, steps)
    ev = _gather_events(g)
    links = Links({"world": {"broadcast": (1e-4, beta)}})
    seconds, net = gather_cost(g, ev, CLUSTER, links)
    assert net == pytest.approx(sum(event_cost(e, CLUSTER, links) for e in ev))
    # each rank's own work: every gap and the tail, and its chunks' steps at rank 0's rate
    per_rank = [gap * (n + 1) + (step * sum(sum(p) for chunks in layout for o, p in chunks if o == r)
                                 if any(o == 0 for chunks in layout for o, _ in chunks) else 0.0) for r in range(4)]
    assert max(net, *per_rank) - 1e-12 <= seconds <= net + sum(per_rank) + 1e-12


def test_trace_records_sharding_gather_as_issued():
    cands = {c.name: c for c in candidates("basic", CLUSTER)}
    t = trace(_spec(), cands["sharding"].strategy(), CLUSTER, repeats=1)
    g = t.steps[0].gather
    # sharding's default: the update interleaved with the gather, so the broadcasts are the
    # optimizer update's, in the layout's order, each from its chunk's owner
    assert g is not None and g.interleaved and g.op == "optimizer_update"
    ev = [e for op, es in t.steps[0].blocking if op == g.op for e in es]
    assert [(e.op, e.root, e.nbytes) for e in ev] == [("broadcast", o, n) for _, ch in g.buckets for o, p in ch for n in p]
    assert {o for _, ch in g.buckets for o, _ in ch} == set(range(CLUSTER.world_size))
    starts = [k for k in range(len(ev)) if g.steps[k] > 0]
    assert starts and all(ev[k].root == 0 for k in starts)  # rank 0 steps its own chunks only
    links = Links.from_rates(intra=(50e-6, 1e9), inter=(100e-6, 1e8), cluster=CLUSTER)
    cost = step_time(t, links)
    assert cost.seconds > cost.compute > 0 and cost.exposed_comm > 0
    # overlap_update off: the update runs whole, then c_allgather_params broadcasts
    opts = dict(cands["sharding"].options)
    opts["sharding_configs"] = {**opts["sharding_configs"], "overlap_update": False}
    from fleetlike import DistributedStrategy

    w = trace(_spec(), DistributedStrategy.from_dict(opts), CLUSTER, repeats=1).steps[0].gather
    assert w is not None and not w.interleaved and w.op == "c_allgather_params" and not any(w.steps)
    assert w.buckets == g.buckets


@given(pts=st.lists(st.tuples(st.integers(1, 1 << 24), st.floats(1e-5, 1.0)), min_size=2, max_size=6, unique_by=lambda p: p[0]),
       size=st.integers(0, 1 << 26))
def test_ladder_cost_reads_the_probed_sizes(pts, size):
    from fleetlike.plan.cost import ladder_cost

    xs = sorted(x for x, _ in pts)
    mono = []
    for _, y in sorted(pts):
        mono.append(max([y, *mono[-1:]]))
    for x, y in zip(xs, mono):  # a probed size costs what was measured (made non-decreasing)
        assert ladder_cost(pts, x) == pytest.approx(y)
    c = ladder_cost(pts, size)
    assert c >= mono[0] - 1e-12  # never below the smallest call's time
    if size <= xs[-1]:
        assert c <= mono[-1] + 1e-12
    else:  # past the ladder: at least the largest size's time, growing with the size
        assert c >= mono[-1] - 1e-12 and ladder_cost(pts, size + 1024) >= c
    # probed links read the ladder; the line (alpha, beta) serves only where there is none
    links = Links({"world": {"all_reduce": (0.5, 0.0)}}, raw={"world": {"all_reduce": pts}})
    assert links.cost("world", "all_reduce", xs[0]) == pytest.approx(mono[0])
    assert Links({"world": {"all_reduce": (0.5, 0.0)}}).cost("world", "all_reduce", xs[0]) == 0.5


def test_16bit_reductions_read_their_own_ladder():
    ladder = [(1 << 10, 1e-3), (1 << 20, 1e-2)]
    slow = [(x, 2 * y) for x, y in ladder]
    raw = {"world": {"all_reduce": ladder, "all_reduce:float16": slow, "broadcast": ladder,
                     "reduce_scatter": ladder}}
    links = Links({"world": {k: (0.0, 1e-8) for k in raw["world"]}}, raw=raw)
    size = 1 << 19
    base = links.cost("world", "all_reduce", size)
    assert links.cost("world", "all_reduce", size, dtype="float16") == pytest.approx(2 * base)
    # bfloat16 not probed: float32's; a broadcast sums nothing: its own ladder, whatever the dtype
    assert links.cost("world", "all_reduce", size, dtype="bfloat16") == pytest.approx(base)
    assert links.cost("world", "broadcast", size, dtype="float16") == pytest.approx(base)
    # a reduction without its own 16-bit ladder: its float32 one (not the allreduce's)
    assert links.cost("world", "reduce_scatter", size, dtype="float16") == pytest.approx(base)
    # the traced fp16 strategy carries float16 on the wire, and its step pays the slower sum
    cands = {c.name: c for c in candidates("basic", CLUSTER)}
    t = trace(_spec(), cands["fp16"].strategy(), CLUSTER, repeats=1)
    buckets = [e for s in t.steps for b in s.buckets for e in b.events]
    assert {(e.op, e.dtype) for e in buckets} == {("all_reduce", "float16"), ("all_reduce", "float64")}
    assert all(e.nbytes == 8 for e in buckets if e.dtype == "float64")  # the overflow guard's max
    world = {k: v for k, v in raw["world"].items()}
    flat = Links({"world": {k: (0.0, 1e-8) for k in world}}, raw={"world": {**world, "all_reduce:float16": ladder}})
    assert sum(event_cost(e, CLUSTER, links) for e in buckets) > sum(event_cost(e, CLUSTER, flat) for e in buckets)


def _probe(role):
    from fleetlike.comm import CommGroups
    from fleetlike.plan.probe import probe_worker
    from fleetlike.testing import make_world

    torch.set_num_threads(1)
    world = make_world(role)
    try:
        links = probe_worker(CommGroups(world, role), sizes=(4 << 10, 64 << 10), reps=2)
        return None if links is None else links.to_json()
    finally:
        world.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_probe_measures_every_kind_op_and_16bit_reduction_on_real_ranks():
    got = run_ranks(_probe, 4, nodes=2, timeout=110)
    assert got[1:] == [None, None, None]  # rank 0 writes the figures
    links = Links.from_json(got[0])
    for kind in ("intra", "inter", "world"):
        names = set(links.raw[kind])
        want = {"all_reduce", "reduce_scatter", "all_gather", "broadcast"}
        want |= {f"{op}:{dt}" for op in ("all_reduce", "reduce_scatter") for dt in ("float16", "bfloat16")}
        assert want <= names, (kind, want - names)
        for name in want:
            sizes = [x for x, _ in links.raw[kind][name]]
            assert sizes == [4 << 10, 64 << 10] and all(y > 0 for _, y in links.raw[kind][name])
        # a float16 reduction is priced from its own ladder
        assert links.cost(kind, "all_reduce", 64 << 10, dtype="float16") == pytest.approx(
            max(y for _, y in links.raw[kind]["all_reduce:float16"]))
    assert {f"broadcast@{r}" for r in range(4)} <= set(links.raw["world"])
    assert links.compute_scale >= 1.0 and links.raw["kernel_seconds_alone"] > 0


def _compute_figures(role):
    import time

    from fleetlike.plan.probe import compute_slowdown, compute_together
    from fleetlike.testing import make_world

    world = make_world(role)
    runs = [0]

    def work() -> float:  # rank r's runs take (r + 1) * 10 ms, its first (a warm-up) 1 s
        runs[0] += 1
        time.sleep(0.002)
        return 1.0 if runs[0] == 1 else (role.rank + 1) * 0.01

    try:
        slowdown, alone, together = compute_slowdown(world, work, window=0.2)
        runs[0] = 0
        again = compute_together(world, work, window=0.2)
        return slowdown, alone, together, again
    finally:
        world.close()


@pytest.mark.timeout(60)
def test_compute_figures_average_every_ranks_median_and_share_rank_0s_alone():
    got = run_ranks(_compute_figures, 4, timeout=50)
    assert len(set(got)) == 1  # every rank gets the same figures
    slowdown, alone, together, again = got[0]
    per_rank = [np.median([(r + 1) * 0.01] * 3) for r in range(4)]  # the first run left out
    assert alone == pytest.approx(0.01)
    assert together == pytest.approx(np.mean(per_rank)) and again == pytest.approx(np.mean(per_rank))
    assert slowdown == pytest.approx(together / alone)


def test_compute_seconds_scales_each_trace_by_its_own_reference():
    cands = {c.name: c for c in candidates("basic", CLUSTER)}
    spec = dataclasses.replace(_spec(), compute_seconds=0.5)
    t = trace(spec, cands["dp"].strategy(), CLUSTER, repeats=3)
    assert t.compute_scale is not None and t.compute_scale > 0
    # the reference is the model's own loss and backward, timed here: about the traced ones
    reference = 0.5 / t.compute_scale
    traced = t.steps[0].times["forward"] + t.steps[0].times["backward"]
    assert 0.3 * traced < reference < 3 * traced, (reference, traced)
    links = Links.from_rates(intra=(50e-6, 1e9), inter=(100e-6, 1e8), cluster=CLUSTER)
    cost = step_time(t, links)
    # the trace's own scale wins over the links' and multiplies the compute
    assert step_time(t, dataclasses.replace(links, compute_scale=100.0)).compute == pytest.approx(cost.compute)
    doubled = step_time(dataclasses.replace(t, compute_scale=2 * t.compute_scale), links)
    assert doubled.compute == pytest.approx(2 * cost.compute)
    assert trace(_spec(), cands["dp"].strategy(), CLUSTER, repeats=1).compute_scale is None
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="compute_seconds"):
            dataclasses.replace(_spec(), compute_seconds=bad)


def test_amp_traces_scale_by_their_own_figure_over_autocast_work(monkeypatch):
    import sys

    trace_mod = sys.modules["fleetlike.plan.trace"]  # the package's `trace` is the function
    asked: list[str | None] = []

    def fake_work(spec, clock, fault_seconds=0.0, amp=None):  # the reference's seconds per dtype
        asked.append(amp)
        return lambda: {None: 0.1, "bfloat16": 0.4}[amp]

    monkeypatch.setattr(trace_mod, "model_work", fake_work)
    cands = {c.name: c for c in candidates("basic", CLUSTER)}
    both = dataclasses.replace(_spec(), compute_seconds=0.5, amp_compute_seconds=1.0)
    assert trace(both, cands["dp"].strategy(), CLUSTER, repeats=1).compute_scale == pytest.approx(0.5 / 0.1)
    assert trace(both, cands["dp+amp"].strategy(), CLUSTER, repeats=1).compute_scale == pytest.approx(1.0 / 0.4)
    # without an AMP figure an AMP trace falls back to float32's, over float32 work
    fp32 = dataclasses.replace(_spec(), compute_seconds=0.5)
    assert trace(fp32, cands["dp+amp"].strategy(), CLUSTER, repeats=1).compute_scale == pytest.approx(0.5 / 0.1)
    assert asked == [None, "bfloat16", None]
    for bad in (0, -2.0, True, "1"):
        with pytest.raises(ValueError, match="amp_compute_seconds"):
            dataclasses.replace(_spec(), amp_compute_seconds=bad)


def test_model_work_runs_the_loss_under_the_autocast_asked_for():
    import fleetlike.plan.spec as spec_mod

    seen: list[tuple[bool, torch.dtype]] = []

    def builder(batch_size: int):
        model, loss_fn, feed = build(batch_size)

        def watched(m, f):
            seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
            return loss_fn(m, f)
        return model, watched, feed

    spec = ModelSpec(builder, 8)
    spec_mod.model_work(spec, amp="bfloat16")()
    spec_mod.model_work(spec)()
    assert seen == [(True, torch.bfloat16), (False, seen[1][1])]
    with pytest.raises(ValueError, match="amp='int8'"):
        spec_mod.model_work(spec, amp="int8")


def test_model_work_times_loss_and_backward_without_page_faults(monkeypatch):
    import fleetlike.plan.spec as spec_mod

    ticks = iter([10.0, 10.25, 20.0, 20.5, 30.0, 31.0])
    run = spec_mod.model_work(_spec(), clock=lambda: next(ticks))
    assert run() == 0.25 and run() == 0.5  # the clock's difference, nothing else
    faults = iter([1000, 1300])  # 300 faults during the run, at 1 ms each
    monkeypatch.setattr(spec_mod, "work_faults", lambda: next(faults))
    run = spec_mod.model_work(_spec(), clock=lambda: next(ticks), fault_seconds=1e-3)
    assert run() == pytest.approx(1.0 - 0.3)

"""Hierarchical allreduce, several communicators and fp16 compression on real gloo ranks.

Two or four loopback "nodes" (127.0.0.1, 127.0.0.2, ...). Hierarchical equals one flat
allreduce (integers exactly, floats to 1e-6 relative), several communicators equal one, fp16/bf16
stay within their rounding bound and never overflow for magnitudes up to 1e5, training with each
option equals single-process SGD, and the bytes each rank sends across nodes match the formulas.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dp_common import batch, loss_fn, make_model, max_diff, params, single_process
from fleetlike import DistributedStrategy, Executor, fleet
from fleetlike.comm import CommGroups
from fleetlike.collectives import (
    CompressedAllReduce,
    FlatAllReduce,
    HalfCodec,
    HierarchicalAllReduce,
    cross_node_bytes_flat,
    hierarchical_pairs,
    segmented_all_reduce,
)
from fleetlike.collectives.segments import Scratch
from fleetlike.roles import Role
from fleetlike.strategies.data_parallel import gradient_collective
from fleetlike.testing import make_world, run_ranks

DTYPES = {"int32": torch.int32, "int64": torch.int64, "float32": torch.float32, "float64": torch.float64}


def _data(seed: int, rank: int, numel: int, dtype: str, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    if dtype.startswith("int"):
        return torch.randint(-1000, 1000, (numel,), generator=g, dtype=DTYPES[dtype])
    return (torch.randn(numel, generator=g, dtype=torch.float64) * scale).to(DTYPES[dtype])


def _compare(role, cases, segment_bytes=1000):
    world = make_world(role)
    groups = CommGroups(world, role)
    try:
        pairs = hierarchical_pairs(groups, 2)
        hier = HierarchicalAllReduce(pairs, world)
        hier_rb = HierarchicalAllReduce(pairs[:1], world, algorithm="reduce_broadcast")
        # tiny segments: every case of a few hundred elements or more is pipelined
        hier_seg = HierarchicalAllReduce(pairs, world, segment_bytes=segment_bytes)
        # the node-local hops as gloo's reduce-scatter + allgather instead of reduces + broadcasts
        hier_seg_rs = HierarchicalAllReduce(pairs, world, segment_bytes=segment_bytes, intra_form="reduce_scatter")
        rings3 = FlatAllReduce(groups.rings(3))
        out = []
        for i, (numel, dtype, seed) in enumerate(cases):
            x = _data(seed, role.rank, numel, dtype)
            for op in ("sum", "avg"):
                flat = world.all_reduce(x.clone(), op)
                h = hier.start_tensor(x.clone(), i, op).wait()
                rb = hier_rb.start_tensor(x.clone(), i, op).wait()
                ring = rings3.rings[i % 3].all_reduce(x.clone(), op)
                seg = hier_seg.start_tensor(x.clone(), i, op).wait()
                seg_rs = hier_seg_rs.start_tensor(x.clone(), i, op).wait()
                out.append((op, dtype, flat.numpy(), h.numpy(), rb.numpy(), ring.numpy(), seg.numpy(), seg_rs.numpy()))
        return out
    finally:
        groups.close()


def _check_equal(op, dtype, ref, got):
    if dtype.startswith("int"):
        np.testing.assert_array_equal(got, ref)
    else:
        scale = np.maximum(np.abs(ref), 1e-30)
        rel = np.abs(got.astype(np.float64) - ref) / scale
        tol = 1e-6 if dtype == "float32" else 1e-12
        # relative to the element, or to the magnitude of the summands where they cancel
        assert np.all((rel <= tol) | (np.abs(got - ref) <= tol * 4 * 10)), (op, dtype, rel.max())


CASE = st.tuples(st.integers(0, 3000), st.sampled_from(sorted(DTYPES)), st.integers(0, 10**6))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nodes,per_node", [
    (2, 2), *(pytest.param(*p, marks=pytest.mark.slow) for p in ((2, 1), (1, 4), (4, 1)))])
@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(cases=st.lists(CASE, min_size=3, max_size=5))
def test_hierarchical_and_rings_equal_flat(nodes, per_node, cases):
    results = run_ranks(_compare, nodes * per_node, cases, nodes=nodes, timeout=60)
    for rank_out in results:
        for op, dtype, flat, *others in rank_out:
            for got in others:
                _check_equal(op, dtype, flat, got)
            if per_node == 2:  # the two intra forms add the same partial sums: bit for bit
                np.testing.assert_array_equal(others[-2], others[-1])
    for a, b in zip(results[0], results[-1]):  # every rank holds the same result
        np.testing.assert_array_equal(a[3], b[3])


# ------------------------------------------------------------------------- fp16


def _fp16(role, cases):
    world = make_world(role)
    groups = CommGroups(world, role)
    try:
        pairs = hierarchical_pairs(groups, 1)
        out = []
        for i, (numel, seed, exp, dtype) in enumerate(cases):
            codec = HalfCodec(dtype)
            colls = {
                "flat": CompressedAllReduce(FlatAllReduce(groups.rings(2)), codec),
                "hier": CompressedAllReduce(HierarchicalAllReduce(pairs, world), codec),
                "mixed": HierarchicalAllReduce(pairs, world, inter_codec=codec),
                # pipelined over 512-byte segments: the casts happen segment by segment
                "hier_seg": CompressedAllReduce(HierarchicalAllReduce(pairs, world, segment_bytes=512), codec),
                "mixed_seg": HierarchicalAllReduce(pairs, world, inter_codec=codec, segment_bytes=512),
                "hier_seg_rs": CompressedAllReduce(HierarchicalAllReduce(pairs, world, segment_bytes=512, intra_form="reduce_scatter"), codec),
                "mixed_seg_rs": HierarchicalAllReduce(pairs, world, inter_codec=codec, segment_bytes=512, intra_form="reduce_scatter"),
                # Fleet's reduce -> leaders' allreduce -> broadcast, compressed on every hop / across only
                "rb": CompressedAllReduce(HierarchicalAllReduce(pairs, world, algorithm="reduce_broadcast"), codec),
                "mixed_rb": HierarchicalAllReduce(pairs, world, algorithm="reduce_broadcast", inter_codec=codec),
            }
            x = _data(seed, role.rank, numel, "float32", 10.0**exp).clamp(-1e5, 1e5)
            if i == 0:
                x = torch.full((numel,), 1e5)  # the worst case: every rank at the limit, same sign
            res = {}
            for name, c in colls.items():
                y = x.clone()
                (c.start_tensor(y, i, "avg") if name.startswith("mixed") else c.start_tensor(y, i)).wait()
                assert y.dtype == torch.float32
                res[name] = y.numpy()
            out.append(res)
        return out
    finally:
        groups.close()


@pytest.mark.timeout(90)
@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(cases=st.lists(st.tuples(st.integers(1, 5000), st.integers(0, 10**6), st.integers(-6, 5),
                                st.sampled_from(["float16", "bfloat16"])), min_size=3, max_size=4))
def test_fp16_within_bound_and_never_overflows(cases):
    n = 4
    results = run_ranks(_fp16, n, cases, nodes=2, timeout=60)
    for i, (numel, seed, exp, dtype) in enumerate(cases):
        xs = [_data(seed, r, numel, "float32", 10.0**exp).clamp(-1e5, 1e5).double().numpy() for r in range(n)]
        if i == 0:
            xs = [np.full(numel, 1e5) for _ in range(n)]
        exact = sum(xs) / n
        mag = sum(np.abs(x) for x in xs) / n
        eps = 2.0**-11 if dtype == "float16" else 2.0**-8
        tol = (n + 2) * eps * mag + 1e-30
        for rank_out in results:
            for name, got in rank_out[i].items():
                assert np.all(np.isfinite(got)), (name, dtype, "overflow")
                err = np.abs(got - exact)
                assert np.all(err <= tol), (name, dtype, float((err / np.maximum(tol, 1e-300)).max()))


# ------------------------------------------------------------------------- bytes


def _bytes(role, numel):
    world = make_world(role)
    groups = CommGroups(world, role)
    try:
        pairs = hierarchical_pairs(groups, 1)
        intra, inter = pairs[0]
        x = torch.ones(numel)
        out = {}
        for name, fn in {
            "flat": lambda: world.all_reduce(x.clone(), "sum"),
            "hier": lambda: HierarchicalAllReduce(pairs, world).start_tensor(x.clone(), 0, "sum").wait(),
            "hier_rs": lambda: HierarchicalAllReduce(pairs, world, intra_form="reduce_scatter").start_tensor(x.clone(), 0, "sum").wait(),
            "hier_fp16": lambda: CompressedAllReduce(HierarchicalAllReduce(pairs, world), HalfCodec()).start_tensor(x.clone(), 0).wait(),
            "mixed": lambda: HierarchicalAllReduce(pairs, world, inter_codec=HalfCodec()).start_tensor(x.clone(), 0).wait(),
        }.items():
            world.barrier()
            for c in (world, intra, inter):
                c.stats.reset()
            fn()
            node_of = [int(e.split(":")[0].rsplit(".", 1)[1]) for e in role.endpoints]
            out[name] = {
                "cross_flat": cross_node_bytes_flat(world.stats.wire_bytes, role.rank, node_of),
                "inter": inter.stats.wire_bytes,
                "intra": intra.stats.wire_bytes,
            }
        return out
    finally:
        groups.close()


@pytest.mark.timeout(60)
def test_cross_node_bytes_match_formulas():
    numel, nodes, L = 3 * 1024 + 1, 2, 2  # odd: the hierarchical buffer is padded
    n, k = nodes * L, nodes
    res = run_ranks(_bytes, n, numel, nodes=nodes, timeout=40)
    s = numel * 4
    padded = (numel + 1) * 4
    ring = lambda op_bytes, m: 2 * (m - 1) * op_bytes // m  # noqa: E731 - bytes one rank sends, ring allreduce
    for rank, r in enumerate(res):
        # flat: a ring over ranks 0..3 crosses nodes at 1->2 and 3->0: the last rank of each
        # node sends its whole 2(N-1)/N * S across, the others nothing
        last_of_node = rank % L == L - 1
        assert r["flat"]["cross_flat"] == (ring(s, n) if last_of_node else 0)
        # hierarchical: every inter-group byte crosses nodes, 2(K-1)/K * S/L per rank
        assert r["hier"]["inter"] == ring(padded // L, k)
        # inside the node (the default intra_form "broadcast", two ranks per node): each rank
        # broadcasts the half its peer sums, then each chunk is broadcast from its owner, 2 x 2
        # broadcasts of S/2; the stats count a broadcast as its whole payload on every rank
        # (`ring_send_bytes`), 2 S in all, where gloo's reduce-scatter + allgather counts
        # 2 (L-1)/L S = S (a rank really sends S/2 per phase either way)
        assert r["hier"]["intra"] == 2 * padded
        assert r["hier_rs"]["intra"] == 2 * ((L - 1) * padded // L)
        assert r["hier_rs"]["inter"] == r["hier"]["inter"]
        # fp16 everywhere: half the bytes, plus the overflow guard's 1-double MAX on each level
        assert r["hier_fp16"]["inter"] == ring(padded // 2 // L, k) + ring(8, k)
        assert r["hier_fp16"]["intra"] == 2 * (padded // 2) + ring(8, L)
        # mixed: full precision inside the node, half across; the scale is agreed on both levels
        assert r["mixed"]["intra"] == 2 * padded + ring(8, L)
        assert r["mixed"]["inter"] == ring(padded // 2 // L, k) + ring(8, k)
    per_node_flat = sum(r["flat"]["cross_flat"] for r in res[:L])
    per_node_hier = sum(r["hier"]["inter"] for r in res[:L])
    assert per_node_flat == ring(s, n)  # 1.5 S leaves each node
    assert abs(per_node_hier - s) <= 8  # S leaves each node (2(K-1)/K = 1 for two nodes)
    assert per_node_flat / per_node_hier == pytest.approx(2 * (n - 1) / n / (2 * (k - 1) / k), rel=1e-3)


# ------------------------------------------------------------------------- training

STEPS = 8
CONFIGS = {
    "hier": {"use_hierarchical_allreduce": True},
    "hier_rb": {"use_hierarchical_allreduce": True, "hierarchical_allreduce_configs.algorithm": "reduce_broadcast"},
    "hier_2comm": {"use_hierarchical_allreduce": True, "nccl_comm_num": 2},
    "hier_block": {"use_hierarchical_allreduce": True, "hierarchical_allreduce_inter_nranks": 2},
    "fp16": {"fp16_allreduce": True},
    "bf16": {"fp16_allreduce": True, "fp16_allreduce_configs.dtype": "bfloat16"},
    "hier_fp16": {"use_hierarchical_allreduce": True, "fp16_allreduce": True, "nccl_comm_num": 2},
    "mixed": {"fp16_allreduce": True, "fp16_allreduce_configs.mode": "mixed"},
}


def _train(role, names):
    with fleet.session(role, timeout=60):
        out = {}
        for name in names:
            model = make_model(100 + role.rank)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            s = DistributedStrategy.from_dict({**CONFIGS[name], "fuse_grad_size_in_MB": 0.001})
            fleet.distributed_optimizer(opt, s).minimize(loss_fn, model)
            exe = Executor()
            exe.run(fleet.startup_program)
            for step in range(STEPS):
                exe.run(fleet.main_program, feed=batch(step, role.rank))
            out[name] = (params(model), str(fleet.main_program), [str(a) for a in fleet.applied_strategy()])
        return out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_training_with_each_option_equals_single_process():
    res = run_ranks(_train, 4, list(CONFIGS), nodes=2, timeout=100)
    ref = single_process("sgd", 4, STEPS)
    for rank, out in enumerate(res):
        for name, (got, listing, applied) in out.items():
            compressed = "16" in name or name == "mixed"
            tol = 1e-6 if not compressed else (2e-3 if name != "bf16" else 1e-2)
            assert max_diff(got, ref) <= tol, (rank, name, max_diff(got, ref))
            assert not any("NOT applied" in a for a in applied if "hierarch" in a or "fp16" in a), applied
    listing = res[0]["hier_fp16"][1]
    assert "intra[node 0]" in listing and "inter[local 0]" in listing and "ring 1" in listing
    assert "wire=float16" in listing and "c_fp16_hierarchical_allreduce_avg" in listing
    assert "float32 intra, float16 inter" in res[0]["mixed"][1]
    assert "intra[block 0]" in res[0]["hier_block"][1]
    assert "wire=bfloat16" in res[0]["bf16"][1]


class _Comm:
    """Names and sizes only: enough for `gradient_collective` to choose, no sockets."""

    def __init__(self, name: str, size: int, rank: int = 0) -> None:
        self.name, self.size, self.rank = name, size, rank


class _Groups:
    """The parts of `CommGroups` that `gradient_collective` uses, for a 2 nodes x 2 ranks job."""

    def __init__(self, role: Role) -> None:
        self.role = role
        self.world = _Comm("world", role.world_size, role.rank)

    def rings(self, n: int) -> list[_Comm]:
        return [self.world] * n

    def extra(self, name: str, color: int, key: int) -> _Comm:
        per_node = self.role.local_size
        return _Comm(name, per_node if name.startswith("intra") else self.role.world_size // per_node, key)


@pytest.mark.parametrize("paddle_config", [
    {"use_hierarchical_allreduce": True, "hierarchical_allreduce_inter_nranks": 1},  # Paddle 2.x default
    {"use_hierarchical_allreduce": True, "hierarchical_allreduce_inter_nranks": 0},  # Paddle 1.x default
    {"use_hierarchical_allreduce": True},  # the key left at its default
])
def test_paddle_inter_nranks_values_mean_ranks_per_node(paddle_config):
    """Paddle reads inter_nranks <= 1 as "the ranks of one node"; a Paddle config
    carried over must group by node, not raise."""
    role = Role.from_endpoints(0, [f"127.0.0.{1 + r // 2}:{6170 + r}" for r in range(4)])
    s = DistributedStrategy.from_dict(paddle_config)
    coll, notes = gradient_collective(s, _Groups(role), role)
    try:
        assert isinstance(coll, HierarchicalAllReduce)
        assert [(intra.name, inter.name) for intra, inter in coll.pairs] == [("intra[node 0]", "inter[local 0]")]
        assert notes[0][:2] == ("use_hierarchical_allreduce", True), notes
    finally:
        coll.workers.shutdown()


def _one_node_and_errors(role):
    with fleet.session(role, timeout=30):
        model = make_model(100)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        s = DistributedStrategy.from_dict({"use_hierarchical_allreduce": True})
        fleet.distributed_optimizer(opt, s).minimize(loss_fn, model)
        applied = [str(a) for a in fleet.applied_strategy()]
        errors = []
        s = DistributedStrategy.from_dict({"use_hierarchical_allreduce": True, "hierarchical_allreduce_inter_nranks": 1})
        fleet.distributed_optimizer(opt, s).minimize(loss_fn, make_model(100))  # Paddle's default: per node
        applied_paddle = [str(a) for a in fleet.applied_strategy()]
        for n in (3,):
            s = DistributedStrategy.from_dict({"use_hierarchical_allreduce": True, "hierarchical_allreduce_inter_nranks": n})
            try:
                fleet.distributed_optimizer(opt, s).minimize(loss_fn, make_model(100))
            except ValueError as e:
                errors.append(str(e))
        return applied, applied_paddle, errors


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_one_node_not_applied_and_fleet_validation():
    res = run_ranks(_one_node_and_errors, 2, nodes=1, timeout=40)
    applied, applied_paddle, errors = res[0]
    assert any("use_hierarchical_allreduce: NOT applied (one node" in a for a in applied), applied
    assert any("use_hierarchical_allreduce: NOT applied (one node" in a for a in applied_paddle), applied_paddle
    assert len(errors) == 1 and "does not divide the world size 2" in errors[0]


def _uneven(role):
    with fleet.session(role, timeout=30):
        model = make_model(100 + role.rank)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        s = DistributedStrategy.from_dict({"use_hierarchical_allreduce": True, "fp16_allreduce": True,
                                           "fp16_allreduce_configs.mode": "mixed"})
        fleet.distributed_optimizer(opt, s).minimize(loss_fn, model)
        exe = Executor()
        exe.run(fleet.startup_program)
        for step in range(4):
            exe.run(fleet.main_program, feed=batch(step, role.rank))
        return params(model), [str(a) for a in fleet.applied_strategy()]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_uneven_nodes_fall_back_to_flat():
    res = run_ranks(_uneven, nodes=(2, 1), timeout=40)  # two ranks on 127.0.0.1, one on 127.0.0.2
    ref = single_process("sgd", 3, 4)
    for got, applied in res:
        assert max_diff(got, ref) <= 1e-6
        assert any("use_hierarchical_allreduce: NOT applied (nodes have unequal" in a for a in applied), applied
        assert any("fp16_allreduce: NOT applied" in a for a in applied), applied


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_pipelined_segments_equal_flat():
    """Buffers of several segments, in default (1 MiB) and odd-sized ~0.75 MiB segments (odd
    sizes: padded tails); 2.5 to 5.3 segments each."""
    cases = [(655_367, "float32", 1), (327_683, "int64", 2), (524_288, "float64", 3)]
    results = run_ranks(_compare, 4, cases, (3 << 18) + 7, nodes=2, timeout=100)
    for rank_out in results:
        for op, dtype, flat, h, _rb, _ring, seg, seg_rs in rank_out:
            _check_equal(op, dtype, flat, h)
            _check_equal(op, dtype, flat, seg)
            # the broadcast form adds the same two partial sums as gloo's reduce-scatter: bit for bit
            np.testing.assert_array_equal(seg, seg_rs)


@pytest.mark.parametrize("values, grad_scale", [([1e300, -3e299, 1e-300], 1.0), ([1e30, -2e29, 5.0], 1e10)])
def test_fp16_guard_keeps_float64_beyond_float32_range_finite(values, grad_scale):
    """The agreed maximum is a float64: a float64 bucket above float32's range (or pushed there by
    grad_scale) is still scaled into float16 instead of overflowing (one rank: sum = identity)."""
    codec = HalfCodec("float16", grad_scale=grad_scale)
    x = torch.tensor(values, dtype=torch.float64)
    got = codec.all_reduce_(x.clone(), lambda t: t, lambda t: t, summands=4, divide=1)
    assert torch.isfinite(got).all(), got
    big = x.abs() >= x.abs().max() * 2.0**-13  # float16 keeps ~14 binades below the bucket's maximum
    assert big.sum() == 2 and torch.allclose(got[big], x[big], rtol=2.0**-10, atol=0.0), (got, x)


def test_intra_form_is_checked_and_scratch_is_reused():
    with pytest.raises(ValueError, match=r"intra_form='ring' is not one of \('broadcast', 'reduce_scatter'\)"):
        segmented_all_reduce(torch.ones(4), None, None, intra_form="ring")  # type: ignore[arg-type]
    scratch = Scratch()
    a = scratch.get(100, torch.float16, torch.device("cpu"))
    b = scratch.get(60, torch.float16, torch.device("cpu"))
    assert b.numel() == 60 and b.data_ptr() == a.data_ptr()  # a smaller request reuses the buffer
    c = scratch.get(60, torch.float16, torch.device("cpu"), slot="recv")
    assert c.data_ptr() != a.data_ptr()  # slots never alias each other

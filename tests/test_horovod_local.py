"""The Horovod face in this process: errors before ``init``, a world of one (no launcher), bad
arguments with their messages, the Adasum slice layout (hypothesis), and ``init(comm=[...])``
on a subset of three gloo ranks."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fleetlike.horovod as hvd
from fleetlike.horovod.adasum import slices
from fleetlike.testing import run_ranks


@pytest.fixture(autouse=True)
def _no_hvd():  # type: ignore[no-untyped-def]
    hvd.shutdown()
    yield
    hvd.shutdown()


@pytest.fixture
def one(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    for var in ("RANK", "WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID",
                "PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM", "PADDLE_TRAINER_ENDPOINTS", "FLEETLIKE_STRATEGY"):
        monkeypatch.delenv(var, raising=False)
    hvd.init()
    yield hvd
    hvd.shutdown()


def test_calls_before_init_say_to_call_init() -> None:
    for call in (hvd.size, hvd.rank, hvd.local_rank, lambda: hvd.allreduce(torch.ones(1)), hvd.barrier,
                 lambda: hvd.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1))):
        with pytest.raises(ValueError, match=r"Horovod has not been initialized; use hvd.init\(\)"):
            call()
    assert not hvd.is_initialized()


def test_world_of_one(one: Any) -> None:
    assert (hvd.size(), hvd.rank(), hvd.local_size(), hvd.local_rank(), hvd.cross_size(), hvd.cross_rank()) == (
        1, 0, 1, 0, 1, 0)
    assert hvd.is_initialized() and hvd.is_homogeneous() and not hvd.mpi_enabled()
    hvd.init()  # idempotent
    x = torch.randn(5)
    for op in (hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product, hvd.Adasum):
        assert torch.equal(hvd.allreduce(x, op=op), x)
    assert torch.equal(hvd.allgather(x), x) and torch.equal(hvd.broadcast(x, 0), x)
    out, got = hvd.alltoall(x, splits=[5])
    assert torch.equal(out, x) and got.tolist() == [5]
    assert hvd.join() == 0
    # one rank: DistributedOptimizer == the plain optimizer, bit for bit
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    b.load_state_dict(a.state_dict())
    opt_a = hvd.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9))
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        xb = torch.randn(8, 4)
        for m, o in ((a, opt_a), (b, opt_b)):
            o.zero_grad()
            m(xb).pow(2).mean().backward()
            o.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert isinstance(opt_a, torch.optim.Optimizer) and opt_a.param_groups is opt_a.inner_optimizer.param_groups


def test_every_faces_reductions_are_the_cores_one_enum() -> None:
    from fleetlike import DistributedStrategy
    from fleetlike.comm import GRID, ReduceOp, SingleCommunicator
    from fleetlike.config.choices import REDUCE_METHOD, ReduceMethod
    from fleetlike.horovod.ops import parse_op

    assert hvd.ReduceOp is ReduceOp is ReduceMethod
    assert [hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product] == [
        ReduceOp.AVG, ReduceOp.SUM, ReduceOp.ADASUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PROD]
    # each API keeps its own spellings of the same members, and names them when refusing
    assert parse_op("Average") is hvd.Average and parse_op("product") is hvd.Product and parse_op(hvd.Max) is hvd.Max
    with pytest.raises(ValueError, match="op='avg' is not a reduction; choose one of 'average', 'sum', 'adasum'"):
        parse_op("avg")
    assert ReduceOp.parse("AVG", GRID) is hvd.Average and ReduceOp.parse(hvd.Product, GRID) is ReduceOp.PROD
    with pytest.raises(ValueError, match=r"op='adasum' is not a reduction; choose one of 'sum', 'avg', 'max', "
                                         r"'min', 'prod' \(Adasum is the Horovod face's"):
        SingleCommunicator().all_reduce(torch.ones(2), hvd.Adasum)
    s = DistributedStrategy(sharding_configs={"gradients_reduce_method": hvd.Sum})
    assert s.sharding_configs["gradients_reduce_method"] == "sum" and REDUCE_METHOD.op("mean") is hvd.Average
    with pytest.raises(ValueError, match=r"gradients_reduce_method must be one of 'mean', 'sum', got 'max'"):
        DistributedStrategy(sharding_configs={"gradients_reduce_method": hvd.Max})


def test_bad_arguments_name_the_field_and_the_fix(one: Any) -> None:
    with pytest.raises(ValueError, match="op='mean' is not a reduction"):
        hvd.allreduce(torch.ones(1), op="mean")
    with pytest.raises(ValueError, match="supersedes average"):
        hvd.allreduce(torch.ones(1), average=True, op=hvd.Sum)
    with pytest.raises(TypeError, match="process_set must be an hvd.ProcessSet"):
        hvd.allreduce(torch.ones(1), process_set=object())
    with pytest.raises(ValueError, match="is not registered"):
        hvd.allreduce(torch.ones(1), process_set=hvd.ProcessSet([0]))
    with pytest.raises(ValueError, match="splits=.* must hold 1"):
        hvd.alltoall(torch.ones(4), splits=[1, 3])
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        hvd.allreduce([1.0])
    with pytest.raises(TypeError, match="must share a dtype"):
        hvd.grouped_allreduce([torch.ones(1), torch.ones(1, dtype=torch.float64)])
    model = torch.nn.Linear(2, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="Compression.none, .fp16 or .bf16"):
        hvd.DistributedOptimizer(sgd, compression=object())
    for bad in (0, -1, True, (model.weight,), "2"):
        with pytest.raises(ValueError, match=r"groups should be a non-negative integer or a list of list"):
            hvd.DistributedOptimizer(sgd, groups=bad)
    with pytest.raises(ValueError, match=r"groups must consist of torch.Tensor: groups\[0\]\[1\] is a str"):
        hvd.DistributedOptimizer(sgd, groups=[[model.weight, "bias"]])
    with pytest.raises(ValueError, match=r"only appear once in groups: groups\[1\]\[0\] \(allreduce.noname.0.0\)"):
        hvd.DistributedOptimizer(sgd, groups=[[model.weight], [model.weight]])
    with pytest.raises(ValueError, match=r"groups\[0\]\[0\] .* is not a parameter of the wrapped optimizer"):
        hvd.DistributedOptimizer(sgd, groups=[[torch.nn.Parameter(torch.ones(2))]])
    with pytest.raises(ValueError, match="backward_passes_per_step=0"):
        hvd.DistributedOptimizer(sgd, backward_passes_per_step=0)
    with pytest.raises(ValueError, match="Found duplicates: w"):
        hvd.DistributedOptimizer(sgd, named_parameters=[("w", p) for p in model.parameters()])
    with pytest.raises(ValueError, match="were not named"):
        hvd.DistributedOptimizer(sgd, named_parameters=[("w", model.weight)])
    with pytest.raises(ValueError, match="should be a sequence of tuples"):
        hvd.DistributedOptimizer(sgd, named_parameters=list(model.parameters()))
    with pytest.raises(ValueError, match="gradient_predivide_factor not supported with op != Average"):
        hvd.DistributedOptimizer(sgd, op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="Average, Sum or Adasum"):
        hvd.DistributedOptimizer(sgd, op=hvd.Max)
    # strategy switches this face cannot apply raise instead of being dropped
    from fleetlike import DistributedStrategy

    for switch in ("localsgd", "sharding", "amp"):
        with pytest.raises(ValueError, match=f"also turns on {switch}. Fix: turn those off"):
            hvd.DistributedOptimizer(sgd, strategy=DistributedStrategy(**{switch: True}))
    # gradient merge is Horovod's own accumulation: a backward_passes_per_step that disagrees is refused
    merge = DistributedStrategy(gradient_merge=True, gradient_merge_configs={"k_steps": 2})
    assert hvd.DistributedOptimizer(sgd, strategy=merge).backward_passes_per_step == 2
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hvd.DistributedOptimizer(sgd, strategy=merge, backward_passes_per_step=3)
    hvd.DistributedOptimizer(sgd, strategy=DistributedStrategy(check_nan_inf=True))  # the face applies it
    hvd.DistributedOptimizer(sgd, strategy=DistributedStrategy(use_hierarchical_allreduce=True, nccl_comm_num=2))
    with pytest.raises(ValueError, match="invalid params of type"):
        hvd.broadcast_parameters(3, root_rank=0)
    with pytest.raises(ValueError, match="LBFGS"):
        hvd.broadcast_optimizer_state(torch.optim.LBFGS(model.parameters()), root_rank=0)


def _grad_hooks(p: torch.Tensor) -> int:
    """Gradient hooks on ``p``: post-accumulate ones and tensor hooks (``register_hook``)."""
    return len(p._post_accumulate_grad_hooks or {}) + len(p._backward_hooks or {})


@pytest.mark.parametrize("op", ["average", "adasum"])
def test_one_gradient_hook_per_parameter_and_one_reduction_per_window(one: Any, op: str) -> None:
    """The optimizer rides the reducer's own hook (Adasum: the core's pass counter), so each
    parameter has one gradient hook; with backward_passes_per_step=3 every bucket is reduced once
    per 3 backward passes; the parameters equal one plain step on the sum of the 3 batches'
    losses (one world: average == sum); a sparse gradient comes back sparse, a 4th pass raises."""
    torch.manual_seed(0)
    make = lambda: torch.nn.ModuleDict({"emb": torch.nn.Embedding(10, 3, sparse=True),  # noqa: E731
                                        "lin": torch.nn.Linear(3, 2)})
    model, ref = make(), make()
    ref.load_state_dict(model.state_dict())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), backward_passes_per_step=3,
                                   op=hvd.Adasum if op == "adasum" else hvd.Average)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    assert [_grad_hooks(p) for p in model.parameters()] == [1, 1, 1]
    batches = [torch.randint(0, 10, (4,), generator=torch.Generator().manual_seed(i)) for i in range(6)]
    loss = lambda m, x: m["lin"](m["emb"](x)).pow(2).sum()  # noqa: E731
    for window in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        for x in batches[3 * window: 3 * window + 3]:
            loss(model, x).backward()
            loss(ref, x).backward()
        opt.synchronize() if op == "average" else None
        if op == "average":
            assert model["emb"].weight.grad.is_sparse  # as SparseAdam needs
        with opt.skip_synchronize() if op == "average" else contextlib.nullcontext():
            opt.step()
        ref_opt.step()
        if op == "average":
            assert opt.reducer.collectives_issued == len(opt.reducer.buckets) * (window + 1)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    assert [_grad_hooks(p) for p in model.parameters()] == [1, 1, 1]
    opt.zero_grad()
    for x in batches[:3]:
        loss(model, x).backward()
    with pytest.raises(AssertionError, match="more than backward_passes_per_step times"):
        loss(model, batches[0]).backward()


def test_groups_become_the_fused_buckets(one: Any) -> None:
    """Horovod's ``groups``: each listed group is one fused reduction, every unlisted trainable
    parameter a group of its own, frozen ones left out; an int n splits the parameters in the
    optimizer's order into n nearly equal runs. The buckets start in the order backward fills them."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    w0, b0, w1, b1, w2, b2 = model.parameters()
    b1.requires_grad_(False)

    def layout(groups: Any) -> list[list[torch.Tensor]]:
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), groups=groups)
        try:
            return [b.params for b in opt.reducer.buckets]
        finally:
            opt._detach()

    def same(got: list[list[torch.Tensor]], want: list[list[torch.Tensor]]) -> bool:
        return [[id(p) for p in g] for g in got] == [[id(p) for p in g] for g in want]

    assert same(layout([[w0, w2], [b1, b0]]), [[b2], [w1], [b0], [w0, w2]])
    assert same(layout(2), [[w2, b2], [w0, b0, w1]])
    assert same(layout(9), [[b2], [w2], [w1], [b0], [w0]])
    mixed = torch.nn.Linear(2, 2).to(torch.float64)
    opt = hvd.DistributedOptimizer(torch.optim.SGD([*model.parameters(), *mixed.parameters()], lr=0.1),
                                   groups=[[w0, mixed.weight, b0]])
    assert [[id(p) for p in b.params] for b in opt.reducer.buckets][-2:] == [[id(w0), id(b0)], [id(mixed.weight)]]


def test_init_arguments_are_checked() -> None:
    with pytest.raises(TypeError, match="every entry must be an hvd.ProcessSet"):
        hvd.init(process_sets=[1])
    with pytest.raises(ValueError, match="a list of hvd.ProcessSet or 'dynamic'"):
        hvd.init(process_sets="static")
    assert not hvd.is_initialized()


@given(st.integers(0, 200), st.sampled_from([1, 2, 4, 8, 16]))
def test_adasum_slices_partition_the_vector(count: int, size: int) -> None:
    """After the halvings the ranks' slices are disjoint, cover the vector, and differ in length
    by at most one: rank r's slice is number bit-reverse(r) in order (vector halving)."""
    got = slices(count, size)
    bits = size.bit_length() - 1
    order = sorted(range(size), key=lambda r: int(format(r, f"0{bits}b")[::-1] or "0", 2))
    at = 0
    for r in order:
        lo, hi = got[r]
        assert lo == at and hi >= lo
        at = hi
    assert at == count
    lengths = [h - l for l, h in got]
    assert max(lengths) - min(lengths) <= max(1, bits)


@pytest.mark.timeout(90)
def test_init_with_a_subset_of_ranks() -> None:
    results = run_ranks(_subset_rank, 3, timeout=80)
    assert results[1] == "excluded: this process is not in comm=[2, 0]"
    assert results[0] == (1, 2, 2.0, 10.0) and results[2] == (0, 2, 2.0, 10.0)


def _subset_rank(role: Any) -> Any:
    import torch

    import fleetlike.horovod as hvd

    hvd.init(comm=[2, 0], role_maker=role)
    try:
        if not hvd.is_initialized():
            try:
                hvd.size()
            except ValueError as exc:
                return "excluded: " + str(exc).split(" given")[0].split(": ", 1)[1]
            return "no error"
        total = hvd.allreduce(torch.tensor([float(role.rank) * 5]), op=hvd.Sum).item()
        return hvd.rank(), hvd.size(), hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item(), total
    finally:
        hvd.shutdown()


def test_names_that_never_repeat_keep_no_handle_alive(one: Any) -> None:
    """A job naming each async op afresh (``grad.<step>``) and synchronizing it: the runtime
    lets every handle go, and a name is taken only while its handle is held unsynchronized."""
    import gc
    import weakref

    from fleetlike.horovod.runtime import runtime

    refs = []
    for step in range(200):
        h = hvd.allreduce_async(torch.ones(3), name=f"grad.{step}")
        refs.append(weakref.ref(h))
        hvd.synchronize(h)
    del h
    gc.collect()
    assert len(runtime().unfinished) == 0 and all(r() is None for r in refs)
    held = hvd.allreduce_async(torch.ones(3), name="held")
    with pytest.raises(ValueError, match="currently being processed"):
        hvd.allreduce_async(torch.ones(3), name="held")
    hvd.synchronize(held)
    assert hvd.synchronize(hvd.allreduce_async(torch.ones(3), name="held")).tolist() == [1.0] * 3

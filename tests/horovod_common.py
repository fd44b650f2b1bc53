"""What every rank of the Horovod-face tests runs, and the references the test process checks
it against (numpy / single-process torch), shared by the gloo and MPI tests.

`rank_suite(hvd, spec)` runs every call of ``fleetlike.horovod`` once on an initialised rank
and returns plain results; `check_suite(results, spec)` recomputes each from the ranks' inputs
(`inputs`), which every rank and the test process derive from the rank number alone.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import numpy as np
import torch

OPS = ("average", "sum", "min", "max", "product")
DTYPES = (torch.float32, torch.float64, torch.int32)
ADASUM_TINY = np.sqrt(np.finfo(np.float64).tiny)


def inputs(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234 + rank)
    out = {
        "f32": torch.randn(3, 4, generator=g),
        "f64": torch.randn(3, 4, generator=g, dtype=torch.float64),
        "i32": torch.randint(1, 4, (3, 4), generator=g, dtype=torch.int32),
        "g0": torch.randn(2, 3, generator=g),
        "g1": torch.randn(5, generator=g),
        "gather": torch.randn(rank + 1, 3, generator=g),
        "bcast": torch.randn(4, generator=g) + rank,
        "rs": torch.randn(7, 2, generator=g),
        "ada0": torch.randn(6, generator=g, dtype=torch.float64),
        "ada1": torch.randn(3, 2, generator=g, dtype=torch.float64),
    }
    return out


def splits_for(rank: int, world: int) -> list[int]:
    return [(rank + j) % 3 for j in range(world)]


def a2a_input(rank: int, world: int) -> torch.Tensor:
    rows = sum(splits_for(rank, world))
    return torch.arange(rows * 2, dtype=torch.float32).view(rows, 2) + 1000 * rank


def key(dtype: torch.dtype) -> str:
    return {torch.float32: "f32", torch.float64: "f64", torch.int32: "i32"}[dtype]


# ------------------------------------------------------------------------------ training


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.fc1 = torch.nn.Linear(6, 8)
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def batch(rank: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(99 + 1000 * step + 100 * micro + rank)
    return torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)


def make_opt(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    if kind == "momentum":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True)
    return torch.optim.Adam(params, lr=0.01)


#: (name, optimizer, backward passes per step, compression, op, scaler)
TRAIN_CASES = [
    ("sgd", "sgd", 1, "none", "average", False),
    ("momentum", "momentum", 1, "none", "average", False),
    ("adam", "adam", 1, "none", "average", False),
    ("sgd_bpps2", "sgd", 2, "none", "average", False),
    ("adam_bpps2", "adam", 2, "none", "average", False),
    ("sgd_fp16", "sgd", 1, "fp16", "average", False),
    ("sgd_sum", "sgd", 1, "none", "sum", False),
    ("adam_scaler", "adam", 1, "none", "average", True),
    ("sgd_noagree", "sgd", 1, "none", "average", False),  # agree=False: no per-step agreement
    ("adam_groups", "adam", 2, "none", "average", False),  # groups: explicit lists, one fused reduction each
    ("sgd_groups", "sgd", 1, "fp16", "average", False),  # groups=2: two runs of parameters
]


def groups_for(name: str, model: torch.nn.Module) -> Any:
    """Horovod's ``groups=`` of the grouped training cases (None for the others)."""
    if name == "adam_groups":
        return [[model.fc1.weight, model.fc2.bias], [model.fc2.weight]]
    return 2 if name == "sgd_groups" else None
STEPS = 3


def train_rank(hvd: Any, case: tuple, rank: int) -> list[np.ndarray]:
    name, kind, bpps, comp, op, use_scaler = case
    model = Net()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(make_opt(kind, model.parameters()), named_parameters=model.named_parameters(),
                                   compression=getattr(hvd.Compression, comp), backward_passes_per_step=bpps,
                                   op=op, gradient_predivide_factor=2.0 if name == "momentum" else 1.0,
                                   agree=not name.endswith("noagree"), groups=groups_for(name, model))
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if use_scaler else None
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(bpps):
            x, y = batch(rank, step, micro)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler is not None:
            opt.synchronize()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            with opt.skip_synchronize():
                scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


def train_reference(case: tuple, world: int) -> list[np.ndarray]:
    """Single process on the concatenated batch: the mean loss over all ranks' rows."""
    name, kind, bpps, comp, op, use_scaler = case
    model = Net()
    opt = make_opt(kind, model.parameters())
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(bpps):
            xs, ys = zip(*(batch(r, step, micro) for r in range(world)))
            loss = torch.nn.functional.cross_entropy(model(torch.cat(xs)), torch.cat(ys))
            (loss * (world if op == "sum" else 1)).backward()
        if use_scaler:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


def train_join_rank(hvd: Any, rank: int) -> tuple[list[np.ndarray], int, int, list[float]]:
    """Uneven data: rank r has 2 + r steps, then joins (answers the others' reductions with zeros).

    Also returns how many collectives the Horovod world ran during the two steps every rank
    takes (none when the buckets carry the join flags: no agreement per step), and the sums of
    an ``hvd.allreduce`` that the ranks still active run after their steps 2 and 3 (between a
    reduction that shows a joined rank and the next)."""
    from fleetlike.horovod.runtime import runtime

    world = runtime().comm
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    calls = 0
    sums = []
    for step in range(2 + rank):
        before = world.stats.total_calls
        opt.zero_grad()
        x, y = batch(rank, step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if step < 2:
            calls += world.stats.total_calls - before
        else:
            sums.append(float(hvd.allreduce(torch.full((1,), float(rank + 1)), op=hvd.Sum)))
    last = hvd.join()
    return [p.detach().numpy().copy() for p in model.parameters()], last, calls, sums


def train_join_reference(world: int) -> list[list[np.ndarray]]:
    """The parameters after each step (a joined rank keeps those of its last own step)."""
    model = Net()
    after = []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2 + world - 1):
        opt.zero_grad()
        active = [r for r in range(world) if step < 2 + r]
        loss = sum(torch.nn.functional.cross_entropy(model(batch(r, step)[0]), batch(r, step)[1]) for r in active)
        (loss / world).backward()  # joined ranks add zeros; the average divides by every rank
        opt.step()
        after.append([p.detach().numpy().copy() for p in model.parameters()])
    return after


# ------------------------------------------------------------------------------ rank side


def _catch(fn: Any, *exc: type[BaseException]) -> str:
    try:
        fn()
    except exc as e:  # noqa: PERF203
        return f"{type(e).__name__}: {e}"
    return "no error"


def rank_suite(hvd: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """Every hvd call once; results as numpy arrays / strings."""
    r, n = hvd.rank(), hvd.size()
    x = inputs(r)
    out: dict[str, Any] = {}
    out["topo"] = (r, n, hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size(),
                   hvd.is_homogeneous(), hvd.mpi_enabled(), hvd.gloo_enabled(), hvd.is_initialized(),
                   hvd.mpi_threads_supported() in (True, False), hvd.nccl_built() in (True, False))
    hvd.init()  # idempotent
    for op in OPS:
        for dt in DTYPES:
            if op == "average" and dt is torch.int32:
                continue
            t = x[key(dt)]
            sync = hvd.allreduce(t, op=op)
            inplace = t.clone()
            hvd.allreduce_(inplace, op=op)
            h = hvd.allreduce_async(t, op=op, name=f"ar.{op}.{key(dt)}")
            h2 = hvd.allreduce_async_(t.clone(), op=op)
            out[f"ar.{op}.{key(dt)}"] = (sync.numpy(), inplace.numpy(), hvd.synchronize(h).numpy(),
                                         hvd.synchronize(h2).numpy(), str(sync.dtype))
    out["ar.scaled"] = hvd.allreduce(x["f32"], op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0).numpy()
    out["ar.average_flag"] = hvd.allreduce(x["f32"], average=False).numpy()
    fp16 = hvd.allreduce(x["f32"], compression=hvd.Compression.fp16)
    out["ar.fp16"] = (fp16.numpy(), str(fp16.dtype))
    out["ar.bf16"] = hvd.allreduce(x["f32"], compression=hvd.Compression.bf16).numpy()
    # autograd: the gradient of an allreduce is the allreduce of the gradient
    w = x["f32"].clone().requires_grad_(True)
    (hvd.allreduce(w, op=hvd.Sum) * (r + 1)).sum().backward()
    out["ar.grad"] = w.grad.numpy()
    grouped = hvd.grouped_allreduce([x["g0"], x["g1"]], op=hvd.Sum)
    g_in = [x["g0"].clone(), x["g1"].clone()]
    hvd.grouped_allreduce_(g_in)
    hg = hvd.grouped_allreduce_async([x["g0"], x["g1"]], op=hvd.Sum, name="grouped")
    out["grouped"] = ([t.numpy() for t in grouped], [t.numpy() for t in g_in],
                      [t.numpy() for t in hvd.synchronize(hg)])
    out["gather"] = (hvd.allgather(x["gather"]).numpy(), hvd.synchronize(hvd.allgather_async(x["gather"])).numpy())
    g = x["gather"].clone().requires_grad_(True)
    (hvd.allgather(g) * 2).sum().backward()
    out["gather.grad"] = g.grad.numpy()
    root = n - 1
    b_in = x["bcast"].clone()
    hvd.broadcast_(b_in, root)
    out["bcast"] = (hvd.broadcast(x["bcast"], root).numpy(), b_in.numpy(),
                    hvd.synchronize(hvd.broadcast_async(x["bcast"], root, name="b")).numpy())
    a2a, got = hvd.alltoall(a2a_input(r, n), splits=splits_for(r, n))
    even = hvd.alltoall(torch.arange(2 * n * 3, dtype=torch.float64).view(2 * n, 3) + 100 * r)
    _, got_t = hvd.alltoall(a2a_input(r, n), splits=torch.tensor(splits_for(r, n), dtype=torch.int64))
    out["a2a"] = (a2a.numpy(), got.tolist(), str(got.dtype), even.numpy(), str(got_t.dtype))
    out["rs"] = (hvd.reducescatter(x["rs"]).numpy(), hvd.reducescatter(x["rs"], op=hvd.Sum).numpy(),
                 hvd.synchronize(hvd.reducescatter_async(x["rs"], op=hvd.Sum, name="rs")).numpy())
    hvd.barrier()
    if n & (n - 1) == 0:
        out["adasum"] = (hvd.allreduce(x["ada0"], op=hvd.Adasum).numpy(),
                         [t.numpy() for t in hvd.grouped_allreduce([x["ada0"], x["ada1"]], op=hvd.Adasum)],
                         hvd.allreduce(x["ada0"].float(), op=hvd.Adasum).numpy())
    else:
        out["adasum"] = _catch(lambda: hvd.allreduce(x["ada0"], op=hvd.Adasum), hvd.AdasumUnsupportedError)
    out["adasum.int"] = _catch(lambda: hvd.allreduce(x["i32"], op=hvd.Adasum), hvd.AdasumUnsupportedError)
    # objects and state
    out["obj"] = (hvd.broadcast_object({"from": r, "list": list(range(r + 2))}, root_rank=root),
                  hvd.allgather_object(("rank", r, "x" * r)))
    model = Net()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(r)
    hvd.broadcast_parameters(model.state_dict(), root_rank=root)
    sd = [p.detach().numpy().copy() for p in model.parameters()]
    model2 = Net()
    with torch.no_grad():
        for p in model2.parameters():
            p.mul_(r + 1)
    hvd.broadcast_parameters(model2.named_parameters(), root_rank=0)
    opt = torch.optim.Adam(model2.parameters(), lr=0.001 * (r + 1), betas=(0.9, 0.99 - 0.01 * r))
    hvd.broadcast_optimizer_state(opt, root_rank=root)  # empty state: created, then root's
    state = opt.state_dict()
    model3 = Net()
    opt3 = torch.optim.Adam(model3.parameters(), lr=0.01)
    if r == root:  # only the root has stepped: the others receive its moments and counter
        for p in model3.parameters():
            p.grad = torch.ones_like(p)
        opt3.step()
    hvd.broadcast_optimizer_state(opt3, root_rank=root)
    st3 = opt3.state_dict()["state"]
    out["params"] = (sd, [p.detach().numpy() for p in model2.parameters()], state["param_groups"][0]["lr"],
                     state["param_groups"][0]["betas"], len(state["state"]),
                     sorted(st3[0]), float(st3[0]["step"]), st3[0]["exp_avg"].numpy(), len(st3))
    # errors: every rank raises the same, then the job goes on
    out["err.shape"] = _catch(lambda: hvd.allreduce(torch.ones(3 + r), name="grad.w"), hvd.CollectiveMismatchError)
    out["err.op"] = _catch(lambda: hvd.allreduce(torch.ones(2), op=hvd.Sum if r == 0 else hvd.Average),
                           hvd.CollectiveMismatchError)
    out["err.dtype"] = _catch(lambda: hvd.allreduce(torch.ones(2, dtype=torch.float64 if r else torch.float32)),
                              hvd.CollectiveMismatchError)
    out["err.root"] = _catch(lambda: hvd.broadcast(torch.ones(2), r), hvd.CollectiveMismatchError)
    h = hvd.allreduce_async(torch.ones(2), name="dup")
    out["err.dup"] = _catch(lambda: hvd.allreduce_async(torch.ones(3), name="dup"), ValueError)
    hvd.barrier()
    time.sleep(0.05)  # completed by now on most runs, each rank at its own moment: still taken
    out["err.dup.done"] = _catch(lambda: hvd.allreduce_async(torch.ones(3), name="dup"), ValueError)
    hvd.synchronize(h)
    out["dup.reused"] = hvd.synchronize(hvd.allreduce_async(torch.ones(2), name="dup")).numpy()
    out["err.model"] = _catch(lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(torch.nn.Linear(3, 2 + r).parameters(), lr=0.1)), hvd.CollectiveMismatchError)
    out["err.rs_op"] = _catch(lambda: hvd.reducescatter(torch.ones(4), op=hvd.Max), ValueError)
    # join: uneven allreduces, Sum and Average; then a collective join does not allow
    got = []
    for k in range(r + 1):
        got.append(hvd.allreduce(torch.full((2,), float(r + 1)), op=hvd.Sum if k % 2 == 0 else hvd.Average).numpy())
    last = hvd.join()
    out["join"] = (got, last)
    # Horovod: the joined rank keeps waiting while the active ranks' allgather raises
    if r == 0:
        out["join.allgather"] = ("joined", hvd.join())
    else:
        out["join.allgather"] = (_catch(lambda: hvd.allgather(torch.ones(1)), hvd.HorovodInternalError), hvd.join())
    hvd.barrier()
    # training
    out["train"] = {c[0]: train_rank(hvd, c, r) for c in TRAIN_CASES}
    out["train.join"] = train_join_rank(hvd, r)
    m = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1))
    torch.nn.functional.cross_entropy(m(batch(r, 0)[0]), batch(r, 0)[1]).backward()
    zero = _catch(opt.zero_grad, AssertionError)
    again = _catch(lambda: torch.nn.functional.cross_entropy(m(batch(r, 1)[0]), batch(r, 1)[1]).backward(),
                   AssertionError, RuntimeError)
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    out["opt.errors"] = (zero, again, [str(w.message) for w in caught], opt.notes, len(opt.reducer.buckets))
    ada = hvd.DistributedOptimizer(torch.optim.SGD(Net().parameters(), lr=0.1), op=hvd.Adasum) if n & (n - 1) == 0 \
        else None
    out["opt.adasum_skip"] = _catch(lambda: ada.skip_synchronize().__enter__(), AssertionError) if ada else None
    if n & (n - 1) == 0:  # Adasum's delta optimizer: one local SGD step, then adasum of the changes
        am = Net()
        aopt = hvd.DistributedOptimizer(torch.optim.SGD(am.parameters(), lr=0.1), op=hvd.Adasum,
                                        named_parameters=am.named_parameters())
        aopt.zero_grad()
        torch.nn.functional.cross_entropy(am(batch(r, 0)[0]), batch(r, 0)[1]).backward()
        aopt.step()
        out["opt.adasum"] = [p.detach().numpy().copy() for p in am.parameters()]
    # sync batch norm: statistics of the global batch
    bn = hvd.SyncBatchNorm(3)
    xb = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(r)).requires_grad_(True)
    yb = bn(xb)
    (yb * (r + 1)).sum().backward()
    out["bn"] = (yb.detach().numpy(), xb.grad.numpy(), bn.running_mean.numpy(), bn.running_var.numpy())
    if spec.get("timeout_case"):
        out["timeout"] = _timeout_case(hvd, spec)
    return out


def _timeout_case(hvd: Any, spec: dict[str, Any]) -> str:
    """Re-initialise with a short timeout; rank 0 allreduces alone: the error names rank 1."""
    role = spec["role"]
    hvd.shutdown()
    hvd.init(role_maker=role, timeout=1.5)
    if hvd.rank() == 0:
        msg = _catch(lambda: hvd.allreduce(torch.ones(2)), hvd.CollectiveTimeoutError, Exception)
    else:
        time.sleep(4.0)  # alive (its connections open) well past rank 0's timeout
        msg = "slept"
    return msg


# ------------------------------------------------------------------------------ references


def _np_reduce(op: str, arrays: list[np.ndarray]) -> np.ndarray:
    stack = np.stack(arrays)
    if op == "average":
        return stack.sum(0) / len(arrays)
    return {"sum": stack.sum, "min": stack.min, "max": stack.max, "product": stack.prod}[op](0)


def adasum_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    dot, na, nb = float(a @ b), float(a @ a), float(b @ b)
    ca = 1.0 - dot / na * 0.5 if na >= ADASUM_TINY else 1.0
    cb = 1.0 - dot / nb * 0.5 if nb >= ADASUM_TINY else 1.0
    return ca * a + cb * b


def adasum_reference(vectors: list[np.ndarray]) -> np.ndarray:
    """The pairwise recursive combination (a binary tree, the lower half always ``a``)."""
    level = [v.astype(np.float64).ravel() for v in vectors]
    while len(level) > 1:
        level = [adasum_pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def reducescatter_rows(dim0: int, world: int) -> list[int]:
    return [dim0 // world + (1 if r < dim0 % world else 0) for r in range(world)]


def strategy_for(spec: dict[str, Any]) -> Any:
    from fleetlike import DistributedStrategy

    s = DistributedStrategy()
    s.fuse_grad_size_in_MB = 0.0002  # ~200 bytes: several buckets for the small test model
    s.nccl_comm_num = spec.get("rings", 1)
    if spec.get("hierarchical"):
        s.use_hierarchical_allreduce = True
    return s


def gloo_rank(role: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """One gloo rank of `fleetlike.testing.run_ranks`."""
    import fleetlike.horovod as hvd

    hvd.init(role_maker=role, strategy=strategy_for(spec), timeout=60.0)
    try:
        return rank_suite(hvd, {**spec, "role": role})
    finally:
        hvd.shutdown()


def mpi_rank(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank under ``mpiexec`` (`mpi_runner`'s ``call`` task): hvd.init() detects MPI."""
    import fleetlike.horovod as hvd

    hvd.init(strategy=strategy_for(spec))
    try:
        return rank_suite(hvd, spec)
    finally:
        hvd.shutdown()


def adasum_optimizer_reference(world: int) -> list[np.ndarray]:
    """start + adasum over ranks of each parameter's SGD change (-lr * its rank's gradient)."""
    deltas = []
    for r in range(world):
        m = Net()
        torch.nn.functional.cross_entropy(m(batch(r, 0)[0]), batch(r, 0)[1]).backward()
        deltas.append([(-0.1 * p.grad).double().numpy() for p in m.parameters()])
    start = [p.detach().double().numpy() for p in Net().parameters()]
    return [s + adasum_reference([d[i] for d in deltas]).reshape(s.shape) for i, s in enumerate(start)]

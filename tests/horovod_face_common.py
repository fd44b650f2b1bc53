"""What every rank of `test_horovod_face` runs: the Horovod semantics beyond the basic suite
(`horovod_common`), each written from Horovod's docs and ``horovod/torch`` sources, returning
plain results that the test process checks against numpy / single-process references.

Covered: build queries; every dtype Horovod moves on every collective; integer prescale /
postscale (float64, truncated) and integer average (truncated toward zero); duplicate names
raising locally; named async ops submitted in different orders on different ranks; process
sets (add, remove, ``init(process_sets=...)``, every collective, roots as Horovod ranks,
DistributedOptimizer inside and outside the set); grouped allgather / reducescatter; sparse
allreduce and sparse gradients (SparseAdam) in DistributedOptimizer; ``_parameter_names``;
join (the last rank to join; a joined rank waits while the others' allgather raises; integer
average with a joined rank); ``hvd.init()`` again after a failed collective.
"""

from __future__ import annotations

import time
from typing import Any

import torch

DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.float16,
          torch.bfloat16, torch.float32, torch.float64)


def data(rank: int, dtype: torch.dtype, rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + seed)
    t = torch.randint(-20, 20, (rows, 3), generator=g)
    if dtype is torch.bool:
        return t > 0
    if dtype is torch.uint8:
        return t.abs().to(dtype)
    return t.to(dtype)


def sparse_input(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7 + rank)
    t = torch.rand(6, 4, generator=g)
    t[t < 0.6] = 0
    return t.to_sparse()


def emb_input(rank: int) -> torch.Tensor:
    return torch.tensor([[1, 2, 4], [4, 3 + rank, 9]])


def _err(fn: Any, kind: type) -> str:
    try:
        fn()
    except kind as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def face_rank(hvd: Any, spec: dict[str, Any]) -> dict[str, Any]:
    r, n = hvd.rank(), hvd.size()
    out: dict[str, Any] = {"built": (hvd.ccl_built(), hvd.ddl_built(), hvd.gloo_built())}
    # every dtype on every collective
    for dt in DTYPES:
        k = str(dt)
        out[f"gather.{k}"] = hvd.allgather(data(r, dt, r + 1)).tolist()
        grouped = hvd.grouped_allgather([data(r, dt, r + 1), data(r, dt, 1, seed=1)])
        out[f"ggather.{k}"] = [g.tolist() for g in grouped]
        out[f"bcast.{k}"] = hvd.broadcast(data(r, dt, 2), root_rank=n - 1).tolist()
        splits = [(r + j) % 3 for j in range(n)]
        got, received = hvd.alltoall(data(r, dt, sum(splits)), splits=splits)
        out[f"a2a.{k}"] = (got.tolist(), received.tolist())
        if dt is not torch.bool:
            out[f"sum.{k}"] = hvd.allreduce(data(r, dt, 2), op=hvd.Sum).tolist()
            out[f"rs.{k}"] = hvd.reducescatter(data(r, dt, 5), op=hvd.Sum).tolist()
    x = data(r, torch.int32, 4)
    out["int.pre"] = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.37).tolist()
    out["int.post"] = hvd.allreduce(x, op=hvd.Sum, postscale_factor=0.37).tolist()
    out["int.avg"] = hvd.allreduce(x, op=hvd.Average).tolist()
    out["int.rs_avg"] = hvd.reducescatter(data(r, torch.int64, 4), op=hvd.Average).tolist()
    out["grs"] = [t.tolist() for t in hvd.grouped_reducescatter([data(r, torch.float32, 4), data(r, torch.float32, 3)],
                                                                 op=hvd.Sum, postscale_factor=0.5)]
    # duplicate names raise locally (rank 0 alone), and named async ops match whatever the order
    if r == 0:
        h = hvd.allreduce_async(torch.ones(2), name="dup")
        out["dup"] = _err(lambda: hvd.allreduce_async(torch.ones(2), name="dup"), ValueError)
    hvd.barrier()
    if r != 0:
        h = hvd.allreduce_async(torch.ones(2), name="dup")
    out["dup.sum"] = hvd.synchronize(h).tolist()
    # a collective that completed with its handle never synchronized frees its name (Horovod's
    # background thread retires it): the name can be submitted again
    h = hvd.allreduce_async(torch.ones(2), name="unsynced")
    while not hvd.poll(h):
        time.sleep(0.005)
    out["dup.freed"] = hvd.allreduce(torch.full((2,), float(r)), name="unsynced").tolist()
    # DistributedOptimizer(groups=...) that differ between ranks: every rank raises at construction
    m = torch.nn.Linear(3, 2)
    groups = [[m.weight], [m.bias]] if r == 0 else [[m.weight, m.bias]]
    out["groups.differ"] = _err(lambda: hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                                                 groups=groups), hvd.CollectiveMismatchError)
    names = ["a", "b", "c"] if r % 2 == 0 else ["c", "a", "b"]
    handles = {nm: hvd.allreduce_async(torch.full((3,), float(ord(nm) + r)), name=nm, op=hvd.Sum) for nm in names}
    out["order"] = {nm: hvd.synchronize(h).tolist() for nm, h in sorted(handles.items())}
    if r == 0:
        out["order.never"] = _err(lambda: hvd.allreduce(torch.ones(1), name="only-on-0"), hvd.CollectiveMismatchError)
    else:
        out["order.never"] = _err(lambda: hvd.allreduce(torch.ones(1), name=f"only-on-{r}"),
                                  hvd.CollectiveMismatchError)
    # process sets
    even, odd = list(range(0, n, 2)), list(range(1, n, 2))
    es, os_ = hvd.add_process_set(even), hvd.add_process_set(odd)
    mine = es if r in even else os_
    other = os_ if r in even else es
    out["ps.ids"] = (es.process_set_id, os_.process_set_id, mine.size(), mine.rank(), mine.included(),
                     other.included())
    out["ps.sum"] = hvd.allreduce(torch.tensor([float(r + 1)]), op=hvd.Sum, process_set=mine).tolist()
    out["ps.gather"] = hvd.allgather(torch.tensor([r]), process_set=mine).tolist()
    out["ps.bcast"] = hvd.broadcast(torch.tensor([r]), root_rank=mine.ranks[-1], process_set=mine).tolist()
    out["ps.obj"] = hvd.broadcast_object(f"from {mine.ranks[0]}", root_rank=mine.ranks[0], process_set=mine)
    out["ps.foreign"] = _err(lambda: hvd.allreduce(torch.ones(1), process_set=other), ValueError)
    out["ps.dupe"] = _err(lambda: hvd.add_process_set(even), ValueError)
    torch.manual_seed(5)
    model = torch.nn.Linear(3, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), named_parameters=model.named_parameters(),
                                   process_set=es)
    model(data(r, torch.float32, 2)).sum().backward()
    opt.step()
    out["ps.opt"] = [p.detach().tolist() for p in model.parameters()]
    hvd.barrier(process_set=mine)
    out["ps.remove"] = (hvd.remove_process_set(os_), hvd.remove_process_set(os_), es.process_set_id is not None,
                        hvd.remove_process_set(hvd.global_process_set))
    hvd.remove_process_set(es)
    # sparse
    handle = hvd.sparse_allreduce_async(sparse_input(r), name="sp", op=hvd.Average)
    out["sparse"] = handle().to_dense().tolist()
    for as_dense in (False, True):
        torch.manual_seed(3)
        emb = torch.nn.Embedding(10, 3, sparse=True)
        sopt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.1),
                                        sparse_as_dense=as_dense)
        sopt.zero_grad()
        emb(emb_input(r)).sum().backward()
        sopt.step()
        out[f"emb.{as_dense}"] = emb.weight.detach().tolist()
        out["names"] = sorted(sopt._parameter_names.values())
    # join: the last rank to join; an allgather raises on the active ranks while joined ranks wait
    for _ in range(r):
        hvd.allreduce(torch.tensor([-75 + r], dtype=torch.int32), op=hvd.Average)
    out["join.last"] = hvd.join()
    if r == 0:
        out["join.gather"] = ("waited", hvd.join())
    else:
        out["join.gather"] = (_err(lambda: hvd.allgather(torch.ones(1)), RuntimeError), hvd.join())
    if n == 2:
        got = hvd.allreduce(torch.tensor([-75], dtype=torch.int32), op=hvd.Average) if r == 1 else None
        out["join.int"] = (hvd.join(), None if got is None else got.tolist())
    # a failed collective (a timeout) closes the world; hvd.init() starts a new one
    if spec.get("recover"):
        hvd.shutdown()
        hvd.init(timeout=2.0, **spec.get("init", {}))
        if r == 0:
            out["fail"] = _err(lambda: hvd.allreduce(torch.ones(1), name="lonely"), RuntimeError)
            hvd.init(**spec.get("init", {}))
        else:
            time.sleep(3.0)
            hvd.shutdown()
            hvd.init(**spec.get("init", {}))
        out["after"] = hvd.allreduce(torch.ones(1), op=hvd.Sum).tolist()
    # init(process_sets=...)
    hvd.shutdown()
    ps = hvd.ProcessSet(list(range(n))[::-1][: max(1, n - 1)])
    hvd.init(process_sets=[ps], **spec.get("init", {}))
    out["init.ps"] = (ps.process_set_id, ps.included(),
                      hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, process_set=ps).tolist() if ps.included() else None)
    return out


def reference(n: int) -> dict[str, Any]:
    """What `face_rank` returns on rank r, computed from the inputs alone (numpy / torch on one
    process), as a function of r."""
    ref: dict[str, Any] = {}
    for dt in DTYPES:
        k = str(dt)
        ref[f"gather.{k}"] = torch.cat([data(q, dt, q + 1) for q in range(n)]).tolist()
        ref[f"ggather.{k}"] = [torch.cat([data(q, dt, q + 1) for q in range(n)]).tolist(),
                               torch.cat([data(q, dt, 1, seed=1) for q in range(n)]).tolist()]
        ref[f"bcast.{k}"] = data(n - 1, dt, 2).tolist()
        if dt is not torch.bool:
            total = sum(data(q, dt, 2).to(torch.int64 if not dt.is_floating_point else torch.float64)
                        for q in range(n))
            ref[f"sum.{k}"] = total.to(dt).tolist()
            rs_total = sum(data(q, dt, 5).to(torch.int64 if not dt.is_floating_point else torch.float64)
                           for q in range(n)).to(dt)
            rows = [5 // n + (1 if q < 5 % n else 0) for q in range(n)]
            ref[f"rs.{k}"] = [rs_total[sum(rows[:q]) : sum(rows[: q + 1])].tolist() for q in range(n)]
    return ref

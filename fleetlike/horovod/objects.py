"""Python objects and model state over the Horovod face: ``broadcast_object``,
``allgather_object``, ``broadcast_parameters``, ``broadcast_optimizer_state``.

Objects travel pickled as uint8 tensors (a size first, then the bytes), as Horovod does, and are
unpickled on the receiving ranks: pickle runs code, so each payload carries an HMAC with the
job's secret (`fleetlike.comm.secret`) and is checked before unpickling; a payload without it
raises `PayloadRefused` and is never loaded. Tensors need no pickle: ``hvd.allgather`` /
``hvd.broadcast`` / ``broadcast_parameters`` move them as they are.
``broadcast_parameters`` accepts a ``state_dict()``, ``named_parameters()`` (a generator or a
list of ``(name, tensor)``) or a list of tensors, and moves them in one collective per dtype
(fleetlike's coalesced broadcast) after one agreement, instead of one collective per tensor.
``broadcast_optimizer_state`` broadcasts every state tensor and the root's hyper-parameters (lr,
betas, momentum, ...: any picklable value) so every rank resumes identically. When the root's
optimizer has not stepped yet, every rank's state is cleared and only the hyper-parameters move
(Horovod instead steps once with zero gradients, which starts Adam's bias correction at step 1);
a rank without state facing a root with state creates it first (Horovod's zero-gradient step,
with the parameters put back afterwards).

Example:
    >>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    >>> hvd.broadcast_optimizer_state(optimizer, root_rank=0)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from fleetlike.collectives import broadcast_coalesced
from fleetlike.collectives.divergence import DivergenceGuard
from fleetlike.comm import CompletedWork, Work, dumps_signed, loads_signed
from fleetlike.horovod.collectives import _agree
from fleetlike.horovod.gather import allgather, broadcast_
from fleetlike.horovod.negotiate import Kind
from fleetlike.horovod.order import submit, synchronize
from fleetlike.horovod.process_sets import process_set_runtime

__all__ = ["allgather_object", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters"]


def _dumps(obj: Any, context: str, sender: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(dumps_signed(obj, context, sender)), dtype=torch.uint8)


def _loads(t: torch.Tensor, context: str, sender: int) -> Any:
    return loads_signed(t.numpy().tobytes(), context, sender)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None, process_set: Any = None) -> Any:
    """``root_rank``'s ``obj`` on every rank (pickled, signed with the job's secret and checked
    before unpickling; other ranks' ``obj`` is ignored).

    Example:
        >>> epoch = hvd.broadcast_object(epoch, root_rank=0)
    """
    rt = process_set_runtime(process_set, "hvd.broadcast_object")
    name = name or type(obj).__name__
    dev = rt.device  # the communicator's (CUDA under NCCL)
    is_root = rt.ranks[rt.comm.rank] == root_rank
    mine = _dumps(obj, "hvd.broadcast_object", root_rank).to(dev) if is_root else None
    size = torch.tensor([mine.numel() if mine is not None else 0], dtype=torch.int64, device=dev)
    broadcast_(size, root_rank, name=f"{name}.sz", process_set=process_set)
    data = mine if mine is not None else torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
    broadcast_(data, root_rank, name=f"{name}.t", process_set=process_set)
    return obj if is_root else _loads(data.cpu(), "hvd.broadcast_object", root_rank)


def allgather_object(obj: Any, name: str | None = None, process_set: Any = None) -> list[Any]:
    """Every rank's ``obj``, in rank order (pickled, signed with the job's secret and checked
    before unpickling; sizes may differ).

    Example:
        >>> hvd.allgather_object({"rank": hvd.rank()})   # [{'rank': 0}, {'rank': 1}]
    """
    rt = process_set_runtime(process_set, "hvd.allgather_object")
    name = name or type(obj).__name__
    data = _dumps(obj, "hvd.allgather_object", rt.comm.rank).to(rt.device)
    sizes = allgather(torch.tensor([data.numel()], dtype=torch.int64, device=rt.device), name=f"{name}.sz",
                      process_set=process_set).tolist()
    gathered = allgather(data, name=f"{name}.t", process_set=process_set).cpu()
    out, at = [], 0
    for sender, n in enumerate(sizes[: rt.comm.size]):
        out.append(obj if sender == rt.comm.rank else _loads(gathered[at : at + n], "hvd.allgather_object", sender))
        at += n
    return out


def _named(params: Any) -> list[tuple[str | None, torch.Tensor]]:
    if isinstance(params, Mapping):
        items = sorted(params.items())
    elif isinstance(params, Iterable) and not isinstance(params, torch.Tensor):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}; pass model.state_dict() or "
                         "model.named_parameters()")
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"hvd.broadcast_parameters: {name or 'an entry'} is a {type(t).__name__}, not a tensor")
    return [(str(k) if k is not None else None, v) for k, v in items]


def broadcast_parameters(params: Any, root_rank: int, process_set: Any = None) -> None:
    """Overwrite every tensor of ``params`` with ``root_rank``'s (model start, resume).

    ``params``: ``model.state_dict()``, ``model.named_parameters()`` or a list of tensors."""
    what = "hvd.broadcast_parameters"
    rt = process_set_runtime(process_set, what)
    items = _named(params)
    tensors = [t for _, t in items]

    def start() -> tuple[Work, Any]:
        _agree(rt, Kind.BROADCAST, "broadcast_parameters", dtype=torch.uint8, root=int(root_rank),
               ntensors=len(tensors), shape=(sum(t.numel() for t in tensors),))
        root = rt.local_root(root_rank, what)
        with torch.no_grad():
            broadcast_coalesced(rt.comm, [t.data for t in tensors], root=root)
        return CompletedWork(None), lambda: None

    synchronize(submit(rt, None, "broadcast_parameters", what, start))
    # the guard proves the broadcast took: every rank of the set now holds root_rank's values
    named = [(n if n is not None else f"params[{i}]", t) for i, (n, t) in enumerate(items)]
    DivergenceGuard(rt.comm, named, what=what).check(f"after broadcasting rank {int(root_rank)}'s")


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None,
                              process_set: Any = None) -> None:
    """Make every rank's optimizer state (tensors and hyper-parameters) ``root_rank``'s.

    ``model`` (Horovod's): the model, whose sparse embeddings get sparse zero gradients when
    the state must be created first."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"hvd.broadcast_optimizer_state: expected a torch optimizer, got {type(optimizer).__name__}")
    # Root's state still empty (no step yet): every rank drops its own, so all are empty and
    # equal, and only the hyper-parameters travel (Horovod would take a zero-gradient step
    # here, which leaves Adam's step counter at 1). Otherwise a rank without state creates
    # it (Horovod's zero-gradient step, parameters put back) to receive the root's.
    root_empty = broadcast_object(not inner.state, root_rank, name="optimizer.empty", process_set=process_set)
    if root_empty:
        inner.state.clear()
        _zero_missing_grads(inner, _sparse_params(model))
    elif not inner.state:
        _create_state(inner, _sparse_params(model))
    # hyper-parameters (lr, betas, momentum, ...) and non-tensor state entries travel pickled
    groups = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
    plain = {i: {k: v for k, v in st.items() if not isinstance(v, torch.Tensor)}
             for i, st in enumerate(_states(inner))}
    root_groups, root_plain = broadcast_object((groups, plain), root_rank, name="optimizer.options",
                                               process_set=process_set)
    if len(root_groups) != len(inner.param_groups):
        raise ValueError(f"hvd.broadcast_optimizer_state: rank {root_rank} has {len(root_groups)} param groups, "
                         f"this rank {len(inner.param_groups)}; build the same optimizer on every rank")
    for g, options in zip(inner.param_groups, root_groups):
        g.update(options)
    tensors = []
    for i, st in enumerate(_states(inner)):
        st.update(root_plain.get(i, {}))
        tensors += [v for _, v in sorted(st.items()) if isinstance(v, torch.Tensor)]
    broadcast_parameters(tensors, root_rank, process_set=process_set)


def _states(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The state dicts of the parameters, in param-group order (a missing one is created empty
    only where the parameter has state: frozen parameters have none on any rank)."""
    return [opt.state[p] for g in opt.param_groups for p in g["params"] if p in opt.state]


def _sparse_params(model: Any) -> set[int]:
    """The parameters of ``model`` with sparse gradients (``nn.Embedding(sparse=True)`` and
    ``nn.EmbeddingBag(sparse=True)``), as Horovod's ``model=`` argument finds them."""
    if model is None:
        return set()
    return {id(m.weight) for m in model.modules()
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse}


def _zero_missing_grads(opt: torch.optim.Optimizer, sparse: set[int]) -> None:
    """What Horovod's zero-gradient step leaves behind without the step itself: every trainable
    parameter that had no gradient has a zero one (sparse for the parameters in ``sparse``), so
    a script may broadcast ``p.grad`` right after."""
    for g in opt.param_groups:
        for p in g["params"]:
            if p.requires_grad and p.grad is None:
                zero = torch.zeros_like(p)
                p.grad = zero.to_sparse() if id(p) in sparse else zero


def _create_state(opt: torch.optim.Optimizer, sparse: set[int]) -> None:
    """Horovod's trick for an optimizer that has not stepped: one step with zero gradients
    (sparse ones for the parameters in ``sparse``) creates its state; the parameters are put
    back so the step changes nothing else. A parameter that had no gradient keeps the zero one,
    as in Horovod (scripts broadcast ``p.grad`` right after)."""
    saved = []
    for g in opt.param_groups:
        for p in g["params"]:
            if p.requires_grad:
                saved.append((p, p.detach().clone(), p.grad))
                zero = torch.zeros_like(p)
                p.grad = zero.to_sparse() if id(p) in sparse else zero
    opt.step()
    with torch.no_grad():
        for p, value, grad in saved:
            p.copy_(value)
            if grad is not None:
                p.grad = grad

"""Sharded construction: a model too large for one rank is never whole on one rank.

Stages 2 and 3 shard a model's parameters, but a model built the usual way exists whole on every
rank first. This unit gives two ways round that, both ending with each rank holding only its
dim-0 shard of every parameter, equal to the same piece of the model built whole under the same
seed:

* **``with fleet.sharded_init():``** (DeepSpeed's ``zero.Init``, Paddle's ``LazyGuard``): inside
  the block every ``nn.Module`` is built as usual, so its initialisers draw from torch's
  generator in their own order, and as soon as a module's outermost ``__init__`` returns its
  parameters are cut: this rank keeps its piece, the module keeps a placeholder of the full
  shape on the meta device. Only one module's own parameters are whole at a time; any code,
  any initialiser, no ``reset_parameters`` needed.
* **a model built under ``torch.device("meta")``**: nothing was drawn while it was built, so the
  draws are replayed, module by module in module order (`torch.nn.Module.named_modules`, the
  order a model's layers are usually made in), each module's own parameters allocated whole,
  ``reset_parameters()`` called on them, and cut (the way torch's FSDP2 documentation and
  torchtitan materialise a meta model, one module at a time). The first module holding a
  tied parameter gives its value; a later holder draws what its construction drew and drops
  it. Equal to the whole build when the model's construction initialises each module by its
  ``reset_parameters`` in that order, starting from the generator's state at the replay.

Either way the ranks must agree: every parameter's checksum, taken while it was whole, is
compared over the ranks before the shards are used (a rank that drew other numbers would
otherwise train another model). Writes into a placeholder after its module was built (a
parent's ``self.apply(init)``) cannot reach the shards and are refused, naming the parameter.

Example:
    >>> with fleet.sharded_init():
    ...     model = TransformerLM()            # each rank holds 1/N of every parameter
    >>> model = fleet.distributed_model(model)  # strategy: sharding stage 2 or 3
"""

from __future__ import annotations

import contextlib
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["PendingShard", "ShardedInit", "ShardedInitError", "is_lazy", "local_chunk", "materialize", "pending_bytes",
           "replay_meta", "sharded_init", "take_pending"]


class ShardedInitError(ValueError):
    """A model built on the meta device or in `sharded_init` cannot be materialised as asked."""


@dataclass
class PendingShard:
    """This rank's piece of one parameter, cut while the parameter was whole."""

    chunk: torch.Tensor
    #: crc32 of the whole parameter's bytes (compared over the ranks)
    checksum: int


#: the attribute of a placeholder (a meta ``nn.Parameter``) that holds its `PendingShard`
_TAG = "_fleetlike_pending"
#: the attribute of a cut parameter that names its placeholder (so a second holder of it gets the same)
_HOLDER = "_fleetlike_placeholder"
_local = threading.local()
#: in-place methods a placeholder may take (they change no value)
_HARMLESS = frozenset({"requires_grad_", "share_memory_", "retain_grad", "detach_"})
_INPLACE_DUNDER = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__idiv__",
                             "__ipow__", "__iand__", "__ior__", "__ixor__"})


def local_chunk(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s dim-0 piece of ``full`` as FSDP2 cuts it (``torch.chunk`` over ``world``,
    an empty piece where the chunks run out), as a tensor of its own."""
    if full.dim() == 0:
        return full.detach().clone()
    chunks = torch.chunk(full.detach(), world, dim=0)
    if rank < len(chunks):
        return chunks[rank].clone()
    return full.new_empty((0, *full.shape[1:]))


def _checksum(t: torch.Tensor) -> int:
    data = t.detach().contiguous().view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return zlib.crc32(data.numpy()) & 0x7FFFFFFF


def _placeholder(p: torch.Tensor, rank: int, world: int) -> torch.nn.Parameter:
    """A meta parameter of ``p``'s shape, carrying this rank's piece of ``p``."""
    holder = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
    setattr(holder, _TAG, PendingShard(local_chunk(p, rank, world), _checksum(p)))
    return holder


def is_lazy(model: torch.nn.Module) -> bool:
    """Whether any parameter of ``model`` is on the meta device (built in `sharded_init` or under
    ``torch.device("meta")``): it must be materialised as shards."""
    return any(p.is_meta for p in model.parameters())


def pending_bytes(model: torch.nn.Module) -> int:
    """The bytes of this rank's pieces that ``model``'s placeholders carry (what sharded
    construction holds of the parameters)."""
    return sum(getattr(p, _TAG).chunk.numel() * p.element_size() for p in model.parameters() if hasattr(p, _TAG))


class _WriteGuard(TorchFunctionMode):
    """Refuses an in-place write into a meta tensor: inside sharded construction those are the
    placeholders (and views of them), whose values live in the shards already cut."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        inplace = (name.endswith("_") and not name.endswith("__") and name not in _HARMLESS) or name in _INPLACE_DUNDER
        target = args[0] if args else None
        if inplace and isinstance(target, torch.Tensor) and target.is_meta:
            raise ShardedInitError(
                f"{self.where}: {name} writes into a parameter whose module was already built and cut into "
                "shards (a meta placeholder holds its place), so the write would be lost; initialise a module's "
                "parameters inside its own __init__ or reset_parameters (not from a parent after it was built), "
                "or build the model whole")
        return func(*args, **kwargs)


class ShardedInit:
    """The state of one ``with fleet.sharded_init():`` block (see the module docstring)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self._depth: dict[int, int] = {}
        self._patched: dict[type, Any] = {}
        self._subclass_hook: Any = None

    # ------------------------------------------------------------ patching __init__

    def _wrap(self, cls: type) -> None:
        if cls in self._patched or "__init__" not in cls.__dict__:
            return
        original = cls.__dict__["__init__"]
        owner = self

        def __init__(module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
            key = id(module)
            owner._depth[key] = owner._depth.get(key, 0) + 1
            try:
                original(module, *args, **kwargs)
            finally:
                owner._depth[key] -= 1
                outermost = owner._depth[key] == 0
                if outermost:
                    del owner._depth[key]
            if outermost and getattr(_local, "active", None) is owner:
                owner.cut(module)

        __init__.__wrapped__ = original  # type: ignore[attr-defined]
        __init__.__qualname__ = getattr(original, "__qualname__", "__init__")
        try:
            cls.__init__ = __init__  # type: ignore[misc]
        except TypeError:  # an extension type: its instances are built by code this block cannot see
            return
        self._patched[cls] = original

    def _wrap_all(self, root: type) -> None:
        stack = [root]
        while stack:
            cls = stack.pop()
            self._wrap(cls)
            stack.extend(cls.__subclasses__())

    def cut(self, module: torch.nn.Module) -> None:
        """Replace every whole parameter of ``module`` (and its children) by a placeholder
        carrying this rank's piece."""
        for sub in module.modules():
            for name, p in list(sub._parameters.items()):
                if p is None or p.is_meta:
                    continue
                holder = getattr(p, _HOLDER, None)  # a tie to a parameter already cut elsewhere
                if holder is None:
                    with torch.no_grad():
                        holder = _placeholder(p, self.rank, self.world)
                    setattr(p, _HOLDER, holder)
                sub._parameters[name] = holder

    # ------------------------------------------------------------ context

    def __enter__(self) -> ShardedInit:
        if getattr(_local, "active", None) is not None:
            raise ShardedInitError("fleet.sharded_init() blocks do not nest; build the model in one block")
        _local.active = self
        self._wrap_all(torch.nn.Module)
        owner = self
        original_hook = torch.nn.Module.__dict__.get("__init_subclass__")

        def __init_subclass__(cls: type, **kwargs: Any) -> None:  # classes defined inside the block
            super(torch.nn.Module, cls).__init_subclass__(**kwargs)
            owner._wrap(cls)

        self._subclass_hook = original_hook
        torch.nn.Module.__init_subclass__ = classmethod(__init_subclass__)  # type: ignore[assignment]
        self._guard = _WriteGuard("fleet.sharded_init()")
        self._guard.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._guard.__exit__(*exc)
        for cls, original in self._patched.items():
            cls.__init__ = original  # type: ignore[misc]
        self._patched.clear()
        if self._subclass_hook is None:
            del torch.nn.Module.__init_subclass__
        else:
            torch.nn.Module.__init_subclass__ = self._subclass_hook  # type: ignore[assignment]
        _local.active = None


@contextlib.contextmanager
def sharded_init(rank: int, world: int) -> Iterator[ShardedInit]:
    """Build modules inside the block as shards of ``world`` ranks (this rank ``rank``)."""
    with ShardedInit(rank, world) as state:
        yield state


# ---------------------------------------------------------------- meta replay

def replay_meta(model: torch.nn.Module, rank: int, world: int) -> None:
    """Give every meta parameter of ``model`` without a piece its piece, replaying each module's
    ``reset_parameters()`` in module order on its own parameters allocated whole, one module at
    a time (see the module docstring); meta buffers are materialised whole the same way."""
    done: set[int] = {id(p) for p in model.parameters() if hasattr(p, _TAG)}
    for path, module in model.named_modules():
        own = [(n, p) for n, p in module._parameters.items() if p is not None and p.is_meta]
        bufs = [(n, b) for n, b in module._buffers.items() if b is not None and b.is_meta]
        fresh = [(n, p) for n, p in own if id(p) not in done]
        if not fresh and not bufs and not (own and hasattr(module, "reset_parameters")):
            continue
        reset = getattr(module, "reset_parameters", None)
        if not callable(reset):
            names = [n for n, _ in fresh] + [n for n, _ in bufs]
            raise ShardedInitError(
                f"module {path or '(root)'} ({type(module).__name__}) holds {names} on the meta device but has no "
                "reset_parameters() to initialise them, so they cannot be materialised with the values a whole "
                "build gives; give the module a reset_parameters() that initialises its own parameters and "
                "buffers (as torch's layers have), or build the model inside `with fleet.sharded_init():` "
                "instead of on the meta device")
        whole: dict[str, torch.nn.Parameter] = {}
        for n, p in own:  # a tied parameter already materialised: draw into a scratch copy, dropped
            whole[n] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
            module._parameters[n] = whole[n]
        for n, b in bufs:  # zeros, then whatever reset_parameters sets
            module._buffers[n] = torch.zeros(b.shape, dtype=b.dtype)
        try:
            with _WriteGuard(f"{type(module).__name__}.reset_parameters() of module {path or '(root)'}"):
                reset()
        finally:
            for n, p in own:
                module._parameters[n] = p
        for n, p in fresh:
            with torch.no_grad():
                setattr(p, _TAG, PendingShard(local_chunk(whole[n], rank, world), _checksum(whole[n])))
            done.add(id(p))
        del whole


def _agree(world: Any, names: list[str], sums: list[int]) -> None:
    """Raise on every rank unless every rank's whole parameters had the same checksums."""
    mine = torch.tensor(sums or [0], dtype=torch.int64, device=world.device)
    every = world.all_gather_flat(mine, agreed=True).view(world.size, -1).cpu()
    differ = (every != every[0]).any(0).nonzero()
    if differ.numel():
        i = int(differ[0])
        ranks = [r for r in range(world.size) if bool(every[r, i] != every[0, i])]
        raise ShardedInitError(
            f"rank {world.rank}: parameter {names[i]!r} was built with other values on ranks {ranks} than on rank 0 "
            "(sharded construction keeps each rank's piece of the values it drew, so every rank must draw the same "
            "numbers); seed torch the same on every rank (torch.manual_seed) before building the model")


def materialize(model: torch.nn.Module, world: Any, device: torch.device, pending: dict[str, PendingShard]) -> int:
    """After ``fully_shard`` on a model whose parameters are meta placeholders: allocate this
    rank's shards (``to_empty``) and fill each from its piece. ``pending`` maps the parameter
    names to their pieces (taken before ``fully_shard``); meta buffers are an error here
    (`replay_meta` materialised them). Returns the bytes of the shards filled."""
    keep = {n: b for n, b in model.named_buffers() if not b.is_meta}
    model.to_empty(device=device)
    for n, b in keep.items():  # to_empty also emptied the buffers, which were whole and real
        owner, _, leaf = n.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = b
    filled = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            piece = pending.pop(name).chunk
            target = p.to_local() if hasattr(p, "to_local") else p
            if tuple(target.shape) != tuple(piece.shape):
                raise ShardedInitError(
                    f"parameter {name!r}: this rank's piece has shape {tuple(piece.shape)} but its shard has "
                    f"{tuple(target.shape)}; sharded construction cuts as FSDP2 shards (dim 0 over "
                    f"{world.size} ranks): build and train on the same number of ranks")
            target.copy_(piece.to(target.device))
            filled += target.numel() * target.element_size()
    return filled


def take_pending(model: torch.nn.Module, world: Any) -> dict[str, PendingShard]:
    """Every parameter's piece by name (replaying the meta ones first), the ranks checked to
    agree on the values; the placeholders let go of their pieces."""
    replay_meta(model, world.rank, world.size)
    pending: dict[str, PendingShard] = {}
    for name, p in model.named_parameters():
        if hasattr(p, _TAG):
            pending[name] = getattr(p, _TAG)
            delattr(p, _TAG)
        else:  # a module built whole, outside the block, then attached: cut it now
            with torch.no_grad():
                pending[name] = PendingShard(local_chunk(p, world.rank, world.size), _checksum(p))
    _agree(world, list(pending), [s.checksum for s in pending.values()])
    return pending

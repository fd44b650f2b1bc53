"""``hvd.init()`` and the process-wide state of the Horovod face: who this rank is, its
communicator, and the in-flight names.

``init`` sits on ``fleet.init``: with no fleet yet it calls it (auto-detecting the launch:
``python -m fleetlike.launch``, ``mpiexec``/``mpirun``, ``torchrun``, Slurm), otherwise it uses
the fleet's communicators, so a script may mix both faces. Under ``mpiexec``/``mpirun`` it runs
on the MPI backend with MPI's host names (`MPIRoleMaker`), as Horovod does. ``init(comm=[ranks])`` makes a
Horovod world of those world ranks (every process calls it; the others stay uninitialised).

Topology follows Horovod: ``local_rank`` / ``local_size`` within the node, ``cross_rank`` /
``cross_size`` among the ranks with this local rank (one per node), ``is_homogeneous`` when every
node has the same number of ranks.

Example:
    >>> import fleetlike.horovod as hvd
    >>> hvd.init()
    >>> hvd.rank(), hvd.size(), hvd.local_rank()
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fleetlike.comm import CommGroups, Communicator
from fleetlike.comm.nccl_setup import nccl_unavailable_reason
from fleetlike.comm.mpi import mpi_available
from fleetlike.config import DistributedStrategy
from fleetlike import elastic
from fleetlike.fleet import fleet
from fleetlike.horovod.negotiate import JOINED
from fleetlike.horovod.speculate import Speculator
from fleetlike.roles import MPIRoleMaker, Role, RoleMaker, detect_source, parse_endpoint

__all__ = [
    "Runtime",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "gloo_built",
    "gloo_enabled",
    "init",
    "is_homogeneous",
    "is_initialized",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "rocm_built",
    "runtime",
    "shutdown",
    "size",
    "split_runtime",
]


class Runtime:
    """What ``hvd.init`` set up; one per process (see `runtime`)."""

    def __init__(self, comm: Communicator, groups: CommGroups, role: Role, device: torch.device,
                 strategy: DistributedStrategy | None, subset: bool, ranks: Sequence[int] | None = None) -> None:
        self.comm = comm
        #: the Horovod ranks of this runtime's members (a process set's), in its rank order
        self.ranks: list[int] = list(range(comm.size)) if ranks is None else list(ranks)
        #: a process set's runtime (not the Horovod world's)
        self.is_set = ranks is not None
        #: inside `order.drive`: whether the call driving may leave its collective pending
        self.driving: bool | None = None
        self.groups = groups
        self.role = role
        self.device = device
        #: the strategy given to ``hvd.init`` (None: the fleet's, with FLEETLIKE_STRATEGY applied)
        self.strategy = strategy
        #: ``comm`` is a comm= subset this face split off (closed with its groups by shutdown)
        self.subset = subset
        #: communicators this face created besides (Adasum's pairs and groups); closed by shutdown
        self.own_comms: list[Communicator] = []
        #: one hvd collective at a time agrees and starts (the exchange and the data keep the
        #: same order on every rank even when hooks run on another thread)
        self.lock = threading.RLock()
        #: names of submitted collectives, each to a weak reference to its Handle (the name is
        #: taken while the handle lives; see `order.claim`)
        self.in_flight: dict[str, Any] = {}
        #: named Handles whose collective may still run, kept alive until it completed
        self.unfinished: set[Any] = set()
        #: the agreed history, from which every rank predicts the next allreduce alike, which
        #: then needs no exchange (`speculate`)
        self.speculator = Speculator(comm, device)
        self.counters: dict[str, int] = {}
        #: DistributedOptimizers by their join id (a joined rank answers their reductions)
        self.optimizers: dict[int, Any] = {}
        self.adasum_comms: list[tuple[Communicator, Communicator]] | None = None
        self._optimizer_groups: CommGroups | None = None
        #: ranks seen joined since the last completed ``join`` (from exchanges and from the
        #: active flags of the optimizers' buckets), for join's "last rank to join"; only grows
        #: within a join epoch, so it does not depend on the order a joined rank saw them in
        self.joined_seen: set[int] = set()
        #: the process sets added on this Horovod world, by id (`fleetlike.horovod.process_sets`)
        self.process_sets: dict[int, Any] = {}
        #: runtimes of the process sets this rank belongs to (closed by shutdown)
        self.children: list[Runtime] = []
        #: async collectives submitted and not yet started, oldest first (`fleetlike.horovod.order`)
        self.pending: list[Any] = []
        hosts = [parse_endpoint(e)[0] for e in role.endpoints]
        locals_ = [hosts[:i].count(h) for i, h in enumerate(hosts)]
        same = [i for i, lr in enumerate(locals_) if lr == locals_[role.rank]]
        self.cross_rank = same.index(role.rank)
        self.cross_size = len(same)

    def optimizer_groups(self) -> CommGroups:
        """Communicators for DistributedOptimizer buckets: a split of the Horovod world (shared by
        every optimizer), so bucket traffic never queues behind the agreement exchanges."""
        if self._optimizer_groups is None:
            sub = self.comm.split(0, self.comm.rank, name=f"{self.comm.name}.hvd-buckets")
            assert sub is not None  # every rank takes part
            self._optimizer_groups = CommGroups(sub, self.role)
        return self._optimizer_groups

    def optimizer_rings(self, key: int, n: int) -> list[Communicator]:
        """``n`` communicators of one optimizer's own (collective on first use of ``key``): a
        joined rank keeps an answer to that optimizer's next reduction posted on them
        (`fleetlike.horovod.join`), which must not pair with another optimizer's buckets."""
        groups = self.optimizer_groups()
        rings = [groups.extra(f"hvd-optimizer-{key}.ring{i}", 0, groups.world.rank) for i in range(n)]
        assert all(r is not None for r in rings)  # color 0 on every rank
        return [r for r in rings if r is not None]

    def local_root(self, root_rank: int, what: str) -> int:
        """``root_rank`` (a Horovod rank, as Horovod's collectives take it even on a process
        set) as a rank of this runtime's communicator."""
        root = int(root_rank)
        if root not in self.ranks:
            where = "this job" if self.ranks == list(range(len(self.ranks))) else f"the process set {self.ranks}"
            raise ValueError(f"{what}: root_rank={root_rank} is not a rank of {where} "
                             f"(choose one of {self.ranks})")
        return self.ranks.index(root)

    def close(self) -> None:
        """Close what this runtime opened (its process sets' runtimes first)."""
        for child in self.children:
            child.close()
        self.children = []
        for opt in list(self.optimizers.values()):
            opt._detach()
        for c in self.own_comms:
            c.close()
        if self._optimizer_groups is not None:
            self._optimizer_groups.close()
        if self.subset:
            self.groups.close()

    def note_states(self, states: Sequence[int]) -> None:
        """Record the ranks an exchange (or an optimizer's flags) showed as joined."""
        self.joined_seen.update(i for i, s in enumerate(states) if s == JOINED)

    def auto_name(self, kind: str) -> str:
        """Horovod's generated name for an unnamed collective (``allreduce.noname.3``)."""
        n = self.counters.get(kind, 0) + 1
        self.counters[kind] = n
        return f"{kind}.noname.{n}"


_RUNTIME: Runtime | None = None
_INIT_LOCK = threading.Lock()
_EXCLUDED: list[int] | None = None  # the comm= list this process is not part of
_OWNS_FLEET = False  # init started the fleet, so shutdown ends it


def runtime(what: str = "this call") -> Runtime:
    """The runtime, or Horovod's error telling to call ``hvd.init()`` first."""
    rt = _RUNTIME
    if rt is None:
        if _EXCLUDED is not None:
            raise ValueError(
                f"{what}: this process is not in comm={_EXCLUDED} given to hvd.init(), so it has no "
                "Horovod communicator; call hvd collectives only on the listed ranks"
            )
        raise ValueError(f"Horovod has not been initialized; use hvd.init() before {what}.")
    return rt


def init(
    comm: Sequence[int] | None = None,
    *,
    role_maker: RoleMaker | Role | None = None,
    strategy: DistributedStrategy | None = None,
    backend: str | None = None,
    timeout: float | None = None,
    check_collectives: bool = False,
) -> None:
    """Initialise the Horovod world (idempotent: a second call does nothing, unless a failed
    collective closed the world, which is then replaced by a new one).

    ``comm``: a list of world ranks forming the Horovod world (every process calls ``init``
    with the same list); None for all ranks. The keyword-only arguments are fleetlike's: the
    role maker (default: detect the launch), the `DistributedStrategy` whose data-parallel
    settings `DistributedOptimizer` uses (fuse_grad_size_in_MB, nccl_comm_num, hierarchical
    and fp16 allreduce; also read from ``FLEETLIKE_STRATEGY``), backend and timeout as
    ``fleet.init``. ``hvd.init`` (`fleetlike.horovod.process_sets.init`) adds Horovod's
    ``process_sets`` on top."""
    global _RUNTIME, _EXCLUDED, _OWNS_FLEET
    if _RUNTIME is not None and _RUNTIME.comm._closed:
        # a failed collective closed this world: start a new one (Horovod's elastic recovery
        # and its own tests call hvd.init() again after a HorovodInternalError)
        shutdown()
        if fleet.initialized and fleet.context().world._closed:
            fleet.shutdown()
    with _INIT_LOCK:
        if _RUNTIME is not None or _EXCLUDED is not None:
            return  # initialised already (or left out by comm=): nothing collective runs again
        if not fleet.initialized and role_maker is None and elastic.ElasticSettings.launched():
            # started with --nnodes: join as fleetlike.elastic does (the world forms in run)
            elastic.init(strategy=strategy, timeout=timeout)
            _OWNS_FLEET = True
        if not fleet.initialized:
            if role_maker is None and backend is None and detect_source() in ("openmpi", "mpich") and mpi_available():
                role_maker = MPIRoleMaker()  # as Horovod under mpirun: the MPI backend, MPI's hosts
            fleet.init(role_maker, strategy=strategy, timeout=timeout, check_collectives=check_collectives,
                       backend=backend)
            _OWNS_FLEET = True
        ctx = fleet.context()
        if strategy is not None and not isinstance(strategy, DistributedStrategy):
            raise TypeError(f"hvd.init: strategy must be a DistributedStrategy, got {type(strategy).__name__}")
        if comm is None:
            _RUNTIME = Runtime(ctx.world, ctx.groups, ctx.role, ctx.device, strategy, False)
            return
        members = _members(comm, ctx.role.world_size)
        _RUNTIME = split_runtime(ctx.world, ctx.role, ctx.device, strategy, members, "hvd")
        if _RUNTIME is None:
            _EXCLUDED = members


def split_runtime(world: Communicator, role: Role, device: torch.device, strategy: DistributedStrategy | None,
                  members: Sequence[int], label: str, process_set: bool = False) -> Runtime | None:
    """Collective over ``world``: a runtime of the ``members`` (ranks of ``world``, in that
    order) on a communicator split off for them; None on the other ranks. A ``process_set``'s
    runtime keeps the members' ranks (Horovod names roots by them); a new Horovod world
    (``init(comm=...)``) numbers its ranks from 0."""
    me = role.rank
    sub = world.split(0 if me in members else None, list(members).index(me) if me in members else 0,
                      name=f"{label}[{','.join(map(str, members))}]")
    if sub is None:
        return None
    sub_role = Role.from_endpoints(list(members).index(me), [role.endpoints[r] for r in members],
                                   job_id=role.job_id, source=role.source, selected_gpus=role.selected_gpus)
    return Runtime(sub, CommGroups(sub, sub_role), sub_role, device, strategy, True,
                   ranks=members if process_set else None)


def _members(comm: Any, world_size: int) -> list[int]:
    if hasattr(comm, "Get_rank"):
        raise TypeError(
            "hvd.init(comm=<mpi4py communicator>): fleetlike builds its own communicators; pass the "
            "list of world ranks instead, e.g. hvd.init(comm=[0, 1])"
        )
    try:
        members = [int(r) for r in comm]
    except (TypeError, ValueError):
        raise TypeError(f"hvd.init(comm={comm!r}): comm must be a list of world ranks") from None
    bad = [r for r in members if not 0 <= r < world_size]
    if not members or bad or len(set(members)) != len(members):
        raise ValueError(
            f"hvd.init(comm={members}): comm must list distinct world ranks in 0..{world_size - 1}"
            + (f"; {bad} are out of range" if bad else "")
        )
    return members


#: called first by `shutdown`, while the world is still open (the timeline registers its writer)
BEFORE_SHUTDOWN: list[Callable[[], None]] = []


def shutdown() -> None:
    """Close what ``init`` opened (the fleet too when ``init`` started it). ``init`` may follow."""
    global _RUNTIME, _EXCLUDED, _OWNS_FLEET
    for before in list(BEFORE_SHUTDOWN):  # a recording timeline is written before the world closes
        before()
    with _INIT_LOCK:
        rt, owned = _RUNTIME, _OWNS_FLEET
        _RUNTIME, _EXCLUDED, _OWNS_FLEET = None, None, False
        if rt is not None:
            rt.close()
        if owned and fleet.initialized:
            fleet.shutdown()


def _follow_world() -> None:
    """An elastic job re-formed the fleet's world (`fleetlike.elastic.run`): ``hvd.rank()``,
    ``hvd.size()`` and the collectives move to it, and every ``hvd.DistributedOptimizer``
    rebuilds its buckets' communicators on it (every rank rebinds its optimizers in the order
    they were built). Process sets belong to the old world and are dropped (add them again in
    a reset callback); a ``comm=`` subset cannot be re-derived from a new membership."""
    global _RUNTIME
    with _INIT_LOCK:
        rt = _RUNTIME
        if rt is None:
            return
        if rt.subset:
            raise RuntimeError(
                "hvd.init(comm=[...]) cannot follow an elastic job's new world (the ranks it lists "
                "belong to the old one); in an elastic job call hvd.init() without comm=")
        optimizers = [rt.optimizers[k] for k in sorted(rt.optimizers)]
        for opt in optimizers:
            opt._detach()
        for ps, _ in rt.process_sets.values():
            ps.process_set_id = None
        rt.process_sets = {}
        for child in rt.children:
            child.close()
        rt.children = []
        for c in rt.own_comms:
            c.close()
        if rt._optimizer_groups is not None:
            rt._optimizer_groups.close()
        ctx = fleet.context()
        _RUNTIME = new = Runtime(ctx.world, ctx.groups, ctx.role, ctx.device, rt.strategy, False)
    for opt in optimizers:
        opt.rebind(new)


elastic.on_world_replaced(_follow_world)


def is_initialized() -> bool:
    """Whether ``hvd.init()`` has run in this process (and ``shutdown`` not since)."""
    return _RUNTIME is not None


def size() -> int:
    """Number of Horovod processes."""
    return runtime("hvd.size()").comm.size


def rank() -> int:
    """This process's Horovod rank."""
    return runtime("hvd.rank()").comm.rank


def local_size() -> int:
    """Number of Horovod processes on this node."""
    return runtime("hvd.local_size()").role.local_size


def local_rank() -> int:
    """This process's rank on its node (pick the GPU with it)."""
    return runtime("hvd.local_rank()").role.local_rank


def cross_size() -> int:
    """Number of nodes with a process of this local rank."""
    return runtime("hvd.cross_size()").cross_size


def cross_rank() -> int:
    """This process's rank among the processes of its local rank (its node's index, on equal nodes)."""
    return runtime("hvd.cross_rank()").cross_rank


def is_homogeneous() -> bool:
    """True when every node runs the same number of processes."""
    return runtime("hvd.is_homogeneous()").role.uniform_nodes()


def mpi_threads_supported() -> bool:
    """Whether MPI runs with MPI_THREAD_MULTIPLE (False when the backend is not MPI)."""
    rt = runtime("hvd.mpi_threads_supported()")
    if rt.comm.backend != "mpi":
        return False
    from mpi4py import MPI

    return bool(MPI.Query_thread() == MPI.THREAD_MULTIPLE)


def mpi_enabled() -> bool:
    """Whether this job's collectives run over MPI."""
    return runtime("hvd.mpi_enabled()").comm.backend == "mpi"


def gloo_enabled() -> bool:
    """Whether this job's collectives run over gloo."""
    return runtime("hvd.gloo_enabled()").comm.backend == "gloo"


def mpi_built() -> bool:
    """Whether the MPI backend can be used here (mpi4py imports)."""
    return mpi_available()


def gloo_built() -> bool:
    """Always True: gloo comes with torch."""
    return True


def nccl_built() -> bool:
    """Whether the NCCL backend can run here (a GPU and CuPy's NCCL)."""
    return nccl_unavailable_reason() is None


def ccl_built() -> bool:
    """False: fleetlike has no oneCCL backend (gloo, MPI and NCCL move the data)."""
    return False


def ddl_built() -> bool:
    """False: fleetlike has no IBM DDL backend."""
    return False


def cuda_built() -> bool:
    """Whether torch sees a CUDA device."""
    return torch.cuda.is_available()


def rocm_built() -> bool:
    """Whether torch is a ROCm build."""
    return bool(getattr(torch.version, "hip", None))

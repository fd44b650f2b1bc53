"""Roles from explicit endpoints: the launcher's ``PADDLE_*`` variables, or arguments.

These are the two role makers of Fleet's collective mode. Both end in
`Role.from_endpoints`, so the node topology is always derived the same way: nodes are the
distinct hosts of the endpoint list, in order of first appearance.

Example:
    >>> env = {"PADDLE_TRAINER_ID": "1",
    ...        "PADDLE_TRAINER_ENDPOINTS": "10.0.0.1:6170,10.0.0.2:6170"}
    >>> PaddleCloudRoleMaker(environ=env).node_index()
    1
"""

from __future__ import annotations

from collections.abc import Sequence

from fleetlike.config import envvars
from fleetlike.roles import _env
from fleetlike.roles.base import RoleMaker
from fleetlike.roles.role import Role, parse_endpoint

__all__ = [
    "PaddleCloudRoleMaker",
    "UserDefinedRoleMaker",
    "UserDefinedCollectiveRoleMaker",
    "paddle_role",
    "is_paddle",
    "single_role",
]

_PADDLE_VARS = (
    envvars.PADDLE_TRAINER_ID,
    envvars.PADDLE_TRAINERS_NUM,
    envvars.PADDLE_TRAINER_ENDPOINTS,
    envvars.PADDLE_CURRENT_ENDPOINT,
)


def is_paddle(environ: _env.Environ) -> bool:
    """True when any of the launcher's ``PADDLE_*`` role variables is set."""
    return any(_env.get(environ, name) is not None for name in _PADDLE_VARS)


def single_role(environ: _env.Environ, source: str = "single") -> Role:
    """Rank 0 of 1, for a plain ``python train.py``, at 127.0.0.1:6170 unless the master says (its
    store listens on a port the OS picks: nobody else joins it, `fleetlike.comm.rendezvous.connect`)."""
    port = _env.base_port(environ)
    host = _env.master_addr(environ) or "127.0.0.1"
    return Role.from_endpoints(
        0,
        [f"{host}:{port}"],
        selected_gpus=_env.selected_gpus(environ),
        job_id=_env.job_id(environ),
        source=source,
    )


def _split_endpoints(text: str) -> list[str]:
    return [e.strip() for e in text.split(",") if e.strip()]


def paddle_role(environ: _env.Environ) -> Role:
    """Read the ``PADDLE_*`` variables the launcher sets; none set gives rank 0 of 1.

    Every contradiction raises ValueError naming the variable and its value: the current
    endpoint missing from the list, a trainer id out of range or at another position than the
    current endpoint, a trainer count that differs from the number of endpoints.
    """
    if not is_paddle(environ):
        return single_role(environ, "single")
    listed = _env.get(environ, envvars.PADDLE_TRAINER_ENDPOINTS)
    current = _env.get(environ, envvars.PADDLE_CURRENT_ENDPOINT)
    trainer_id = _env.get_int(environ, envvars.PADDLE_TRAINER_ID)
    trainers = _env.get_int(environ, envvars.PADDLE_TRAINERS_NUM)

    if listed is not None:
        endpoints = _split_endpoints(listed)
        for i, endpoint in enumerate(endpoints):
            parse_endpoint(endpoint, name=f"PADDLE_TRAINER_ENDPOINTS[{i}]")
        seen: dict[str, int] = {}
        for i, endpoint in enumerate(endpoints):
            if endpoint in seen:
                raise ValueError(
                    f"PADDLE_TRAINER_ENDPOINTS={listed!r} lists {endpoint!r} twice (positions "
                    f"{seen[endpoint]} and {i}); every trainer needs its own ip:port"
                )
            seen[endpoint] = i
    elif current is not None:
        endpoints = [current]
    else:
        given = " / ".join(
            f"{name}={value}"
            for name, value in (("PADDLE_TRAINER_ID", trainer_id), ("PADDLE_TRAINERS_NUM", trainers))
            if value is not None
        )
        raise ValueError(
            f"PADDLE_TRAINER_ENDPOINTS is not set but {given} "
            f"{'are' if ' / ' in given else 'is'}; set the comma-separated ip:port list of all "
            "trainers (python -m fleetlike.launch does this)"
        )
    if not endpoints:
        raise ValueError(f"PADDLE_TRAINER_ENDPOINTS={listed!r} holds no ip:port")

    if trainers is not None and trainers != len(endpoints):
        what = "PADDLE_TRAINER_ENDPOINTS" if listed is not None else "PADDLE_CURRENT_ENDPOINT"
        raise ValueError(
            f"PADDLE_TRAINERS_NUM={trainers} but {what} lists {len(endpoints)} endpoint(s); "
            "they must agree"
        )
    position = None
    if current is not None:
        parse_endpoint(current, name="PADDLE_CURRENT_ENDPOINT")
        if current not in endpoints:
            raise ValueError(
                f"PADDLE_CURRENT_ENDPOINT={current!r} is not in PADDLE_TRAINER_ENDPOINTS={listed!r}"
            )
        position = endpoints.index(current)
    if trainer_id is None:
        if position is None:
            raise ValueError(
                "PADDLE_TRAINER_ID is not set and PADDLE_CURRENT_ENDPOINT is not set either; "
                "set PADDLE_TRAINER_ID to this trainer's index in PADDLE_TRAINER_ENDPOINTS"
            )
        trainer_id = position
    if not 0 <= trainer_id < len(endpoints):
        raise ValueError(
            f"PADDLE_TRAINER_ID={trainer_id} is out of range 0..{len(endpoints) - 1} for "
            f"{len(endpoints)} endpoint(s) in PADDLE_TRAINER_ENDPOINTS"
        )
    if position is not None and position != trainer_id:
        raise ValueError(
            f"PADDLE_TRAINER_ID={trainer_id} but PADDLE_CURRENT_ENDPOINT={current!r} is at "
            f"position {position} of PADDLE_TRAINER_ENDPOINTS; they must agree"
        )
    return Role.from_endpoints(
        trainer_id,
        endpoints,
        selected_gpus=_env.selected_gpus(environ),
        job_id=_env.job_id(environ),
        source="paddle",
        master_hosted=_env.agent_store(environ),
    )


class PaddleCloudRoleMaker(RoleMaker):
    """Fleet's default role maker: reads what ``python -m fleetlike.launch`` sets.

    ``is_collective=False`` (parameter-server mode) is refused: fleetlike only does collective
    training. ``environ`` defaults to ``os.environ``; tests pass a dict.
    """

    def __init__(self, is_collective: bool = True, *, environ: _env.Environ | None = None) -> None:
        if not is_collective:
            raise ValueError(
                "PaddleCloudRoleMaker(is_collective=False) asks for parameter-server mode, which "
                "fleetlike does not support; use is_collective=True (collective training)"
            )
        self.is_collective = True
        super().__init__(paddle_role(_env.environ_or_default(environ)))


class UserDefinedRoleMaker(RoleMaker):
    """An explicit rank and endpoint list, for clusters without a launcher.

    Example: ``UserDefinedRoleMaker(current_id=0, worker_endpoints=["10.0.0.1:6170",
    "10.0.0.2:6170"])`` on the first machine, ``current_id=1`` on the second.
    """

    def __init__(
        self,
        current_id: int = 0,
        worker_endpoints: Sequence[str] | str | None = None,
        *,
        selected_gpus: Sequence[int] = (),
        job_id: str = "default",
    ) -> None:
        if worker_endpoints is None:
            raise ValueError("worker_endpoints is required: the ip:port of every worker, in rank order")
        if isinstance(worker_endpoints, str):
            worker_endpoints = _split_endpoints(worker_endpoints)
        if isinstance(current_id, bool) or not isinstance(current_id, int):
            raise TypeError(f"current_id must be an int, got {type(current_id).__name__} {current_id!r}")
        n = len(worker_endpoints)
        if not 0 <= current_id < max(n, 1):
            raise ValueError(
                f"current_id={current_id} is out of range 0..{n - 1} for {n} worker_endpoints"
            )
        super().__init__(
            Role.from_endpoints(
                current_id,
                list(worker_endpoints),
                selected_gpus=selected_gpus,
                job_id=job_id,
                source="user",
            )
        )


#: Fleet 1.x name of `UserDefinedRoleMaker` (seed 003); the very same class.
UserDefinedCollectiveRoleMaker = UserDefinedRoleMaker

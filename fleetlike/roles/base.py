"""The questions every role maker answers, asked of the one `Role` it produced.

A role maker is resolved once, in its constructor, so a bad environment fails at the line where
the user builds it rather than deep inside ``fleet.init``. After that it is a read-only view of a
frozen `Role`; the Fleet-style methods below exist so that a Paddle user's calls keep working.

Example:
    >>> from fleetlike.roles import UserDefinedRoleMaker
    >>> maker = UserDefinedRoleMaker(1, ["127.0.0.1:6170", "127.0.0.1:6171"])
    >>> maker.worker_index(), maker.worker_num(), maker.is_first_worker()
    (1, 2, False)
"""

from __future__ import annotations

from fleetlike.roles.role import Role

__all__ = ["RoleMaker"]


class RoleMaker:
    """Base of all role makers: holds the resolved `Role` and answers Fleet's questions."""

    def __init__(self, role: Role) -> None:
        if not isinstance(role, Role):
            raise TypeError(f"role must be a fleetlike.roles.Role, got {type(role).__name__}")
        self._role = role

    @property
    def role(self) -> Role:
        """The frozen role this maker resolved."""
        return self._role

    def generate_role(self) -> Role:
        """Fleet's name for resolving the role; here it was resolved already, so this returns it."""
        return self._role

    def worker_index(self) -> int:
        return self._role.rank

    def worker_num(self) -> int:
        return self._role.world_size

    def worker_endpoints(self, to_string: bool = False) -> list[str] | str:
        """Every rank's ``ip:port``; ``to_string=True`` joins them with commas as Fleet does."""
        endpoints = list(self._role.endpoints)
        return ",".join(endpoints) if to_string else endpoints

    def current_endpoint(self) -> str:
        return self._role.current_endpoint

    def is_first_worker(self) -> bool:
        return self._role.rank == 0

    def local_rank(self) -> int:
        return self._role.local_rank

    def local_size(self) -> int:
        return self._role.local_size

    def node_index(self) -> int:
        return self._role.node_index

    def node_num(self) -> int:
        return self._role.node_num

    def is_worker(self) -> bool:
        """Always True: collective mode has only workers (no parameter servers)."""
        return True

    def is_server(self) -> bool:
        return False

    def server_num(self) -> int:
        return 0

    def __repr__(self) -> str:
        r = self._role
        return (
            f"{type(self).__name__}(rank={r.rank}, world_size={r.world_size}, "
            f"local_rank={r.local_rank}/{r.local_size}, node={r.node_index}/{r.node_num}, "
            f"source={r.source!r})"
        )

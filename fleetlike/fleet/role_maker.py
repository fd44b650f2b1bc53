"""Fleet's module name for the role makers: ``from fleetlike import role_maker``.

Paddle users write ``role_maker.PaddleCloudRoleMaker(is_collective=True)`` (seed 003); this
module is `fleetlike.roles` under that name, re-exporting the same objects.
"""

from fleetlike.roles import *  # noqa: F401,F403
from fleetlike.roles import __all__ as _roles_all

__all__ = list(_roles_all)

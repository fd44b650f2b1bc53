"""EPL's configuration entry points (seed 002): ``epl.Config(param_dict)`` and ``epl.init(config)``.

EPL configures a job with a dict of dotted keys and one init call::

    import fleetlike.epl as epl            # was: import epl
    config = epl.Config({"gradient_checkpoint.type": "auto", "amp.level": "O1"})
    epl.init(config)

`Config` is a `DistributedStrategy` built from the dict (every key of EPL's configuration page
is an option, an alias of one, or refused with the reason: `fleetlike.config.epl_keys`);
`init` is ``fleet.init(strategy=config)``. The PyTorch training code then wraps its model and
optimizer as in any fleetlike script (``fleet.distributed_model`` /
``fleet.distributed_optimizer``), which apply the configuration.

Example:
    >>> config = Config({"communication.num_communicators": 2})
    >>> config.nccl_comm_num
    2
"""

from __future__ import annotations

from typing import Any

from fleetlike.config import DistributedStrategy
from fleetlike.config.epl_env import EplConfig
from fleetlike.fleet import fleet

__all__ = ["Config", "init"]


class Config(EplConfig):
    """EPL's ``Config(param_dict=None)``: a `DistributedStrategy` from EPL's dotted keys (or any
    key `DistributedStrategy.update` takes) over the defaults the ``EPL_*`` variables set
    (`fleetlike.config.epl_env`); an unknown key raises with the nearest name."""

    __slots__ = ()


def init(config: DistributedStrategy | None = None, **kwargs: Any) -> None:
    """EPL's ``init(config)``: ``fleet.init(is_collective=True, strategy=config)`` (the job's
    roles from whatever launched it); ``kwargs`` go to `fleet.init` (``timeout``, ``backend``)."""
    fleet.init(strategy=config or Config(), **kwargs)

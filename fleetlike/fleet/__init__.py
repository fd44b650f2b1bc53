"""The fleet facade (API.md section 4): ``from fleetlike import fleet``."""

from fleetlike.fleet.facade import Fleet, fleet, load_inference_model
from fleetlike.fleet.model import DistributedModel
from fleetlike.fleet.optimizer import DistributedOptimizer
from fleetlike.fleet.util import Util, file_shard

__all__ = ["DistributedModel", "DistributedOptimizer", "Fleet", "Util", "file_shard", "fleet", "load_inference_model"]

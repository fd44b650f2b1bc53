"""The strategy planner: predict each strategy's step time, bytes and memory before running.

fleetlike knows exactly which collectives a strategy issues: its programs are built by code
(`fleetlike.strategies`). The planner builds them for every rank of the planned cluster in one
process over dry communicators (`dry`), runs rank 0's step and records each collective with its
size, group and phase (`trace`), costs them with alpha-beta figures per group kind and op
(`cost`, measured by `probe` on the real cluster), sizes each rank's memory (`memory`), and
ranks the candidates of a documented search space (`space`) in a table (`planner`).

Example:
    >>> from fleetlike.plan import Cluster, Links, ModelSpec, plan, format_table
    >>> links = Links.load("links.json")                       # python -m fleetlike.plan --probe
    >>> result = plan(ModelSpec(build, 16), Cluster(2, 2), links)
    >>> print(format_table(result)); result.recommended.candidate.strategy().save("s.json")
"""

from fleetlike.plan.cost import Links, StepCost, step_time
from fleetlike.plan.memory import MemoryBreakdown
from fleetlike.plan.planner import PlanResult, PlanRow, annotate, format_table, plan
from fleetlike.plan.space import Candidate, MathChange, SpaceName, candidates, parse_allow
from fleetlike.plan.spec import Cluster, ModelSpec, OptimizerKind, load_builder, parse_cluster
from fleetlike.plan.trace import Trace, trace

__all__ = [
    "Candidate",
    "Cluster",
    "Links",
    "MathChange",
    "MemoryBreakdown",
    "ModelSpec",
    "OptimizerKind",
    "PlanResult",
    "PlanRow",
    "SpaceName",
    "StepCost",
    "Trace",
    "annotate",
    "candidates",
    "format_table",
    "load_builder",
    "parse_allow",
    "parse_cluster",
    "plan",
    "step_time",
    "trace",
]

"""Training steps as data: `Program` (ordered, printable ops) and the `Executor` that runs it."""

from fleetlike.program.executor import CPUPlace, CUDAPlace, Executor
from fleetlike.program.program import Op, Program, StepState

__all__ = ["CPUPlace", "CUDAPlace", "Executor", "Op", "Program", "StepState"]

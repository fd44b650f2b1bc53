"""Small one-process jobs of every checkpoint kind, and bit-for-bit snapshots of their state.

Each job is built in this process (a world of one binds no port), trained a few steps so that
optimizer, strategy and scheduler states are not empty, and saved with the public calls. The
same builders made the format-2 fixture under tests/fixtures (the layout before file-level
versions), so a test loads it into the very objects it was saved from.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from dp_common import batch, loss_fn, make_model
from fleetlike import DistributedStrategy, Executor, elastic, fleet
from fleetlike.roles import UserDefinedRoleMaker

KINDS = ("program", "eager", "sharded", "elastic")
FIXTURES = Path(__file__).parent / "fixtures" / "checkpoint_format2"


class Job:
    """What a test needs of a running job: its stateful objects, save and load."""

    def __init__(self, kind: str, models: list[torch.nn.Module], optimizers: list[Any], extras: dict[str, Any],
                 step: Any, state: Any = None) -> None:
        self.kind, self.models, self.optimizers, self.extras, self.step, self.state = \
            kind, models, optimizers, extras, step, state

    def save(self, dirname: str | Path) -> None:
        if self.state is not None:
            self.state.directory = Path(dirname)
            self.state.commit()
        else:
            fleet.save_persistables(Executor(), str(dirname))

    def load(self, dirname: str | Path) -> Any:
        if self.state is not None:
            self.state.directory = Path(dirname)
            return self.state.load()
        return fleet.load_persistables(Executor(), str(dirname))

    def snapshot(self) -> dict[str, Any]:
        """Every state the job holds, cloned (the elastic state's committed copy included)."""
        out: dict[str, Any] = {
            "models": [_clone(m.state_dict()) for m in self.models],
            "optimizers": [_clone(o.state_dict()) for o in self.optimizers],
            "extras": {k: _clone(v.state_dict()) for k, v in self.extras.items()},
        }
        if self.state is not None:
            out["elastic"] = (self.state.commits, _clone(self.state._committed), self.state.epoch)
        return out


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def bitwise_equal(a: Any, b: Any) -> bool:
    """Same structure, same values, same bits (dtype, shape and bytes of every tensor)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(bitwise_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(bitwise_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@contextmanager
def one_process() -> Iterator[None]:
    with fleet.session(UserDefinedRoleMaker(0, ["127.0.0.1:6170"])):
        yield


def _scheduler(opt: Any) -> torch.optim.lr_scheduler.StepLR:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def build(kind: str, seed: int = 1, steps: int = 2) -> Job:
    """A job of ``kind`` (one of `KINDS`) trained ``steps`` steps; call inside `one_process`."""
    model = make_model(seed)
    if kind == "program":
        strategy = DistributedStrategy.from_dict({"localsgd": True, "localsgd_configs": {"k_steps": 2}})
        opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), strategy)
        opt.minimize(loss_fn, model)
        Executor().run(fleet.startup_program)
        sched = _scheduler(opt)
        fleet.register_state("sched", sched)

        def step(i: int) -> None:
            fleet.main_program.run(batch(i, 0))
            sched.step()

        job = Job(kind, [model], [opt], {"sched": sched}, step)
    elif kind in ("eager", "sharded"):
        options = {"sharding": True, "sharding_configs": {"sharding_degree": 0}} if kind == "sharded" \
            else {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}}
        dmodel = fleet.distributed_model(model)
        opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                          DistributedStrategy.from_dict(options))
        sched = _scheduler(opt)
        fleet.register_state("sched", sched)

        def step(i: int) -> None:
            opt.zero_grad()
            loss_fn(dmodel, batch(i, 0)).backward()
            opt.step()
            sched.step()

        job = Job(kind, [model], [opt], {"sched": sched}, step)
    elif kind == "elastic":
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        state = elastic.TorchState(model=model, optimizer=opt, epoch=0)

        def step(i: int) -> None:
            opt.zero_grad()
            loss_fn(model, batch(i, 0)).backward()
            opt.step()
            state.epoch = i + 1

        job = Job(kind, [model], [opt], {}, step, state)
    else:
        raise ValueError(f"kind {kind!r}: one of {KINDS}")
    for i in range(steps):
        job.step(i)
    return job

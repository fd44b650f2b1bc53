"""`PipelineModel`: what ``fleet.distributed_model(model, loss_fn=...)`` returns under
``strategy.pipeline``: this rank's stage of the model, trained with Paddle's ``train_batch``.

Each rank keeps only its stage's blocks (the other blocks of the model it was given are moved to
the ``meta`` device: their memory is freed), so ``model.parameters()`` -- what the optimizer is
built on -- and the optimizer state are this stage's share. One ``train_batch((x, y), opt)`` is
one optimizer step: the batch is cut into ``accumulate_steps`` micro-batches that run through
the stages on the 1F1B or GPipe schedule (`fleetlike.pipeline.runner`: torch's
``Schedule1F1B`` / ``ScheduleGPipe`` op for op, with less work between the ops;
``eval_batch`` runs torch's own), each stage's gradients are averaged over the pipelines (data parallel
across pipelines, fleetlike's buckets), the optimizer steps, and the mean micro-batch loss,
computed on the last stage, is returned on every rank of the pipeline.

``loss_fn(output, y)`` is the loss of one micro-batch, a mean over its rows (as
``F.cross_entropy``'s default): the gradients are then divided by the number of micro-batches,
so a step equals one step on the whole batch.

``state_dict()`` holds this stage's tensors under the unsplit model's names;
``load_state_dict`` takes this stage's part or a whole model's state (plain data parallel's);
`fleetlike.fleet.full_state_dict` gathers every stage's.

Example:
    >>> model = fleet.distributed_model(torch.nn.Sequential(*blocks), loss_fn=F.cross_entropy)
    >>> opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    >>> loss = model.train_batch((x, y), opt)
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from fleetlike.collectives import Bucket, broadcast_coalesced, plan_buckets
from fleetlike.config import DistributedStrategy
from fleetlike.pipeline.failure import FailureGuard
from fleetlike.pipeline.runner import StageRunner
from fleetlike.pipeline.split import StagePlan
from fleetlike.pipeline.topology import HybridCommunicateGroup
from fleetlike.strategies.amp import autocast as amp_autocast
from fleetlike.strategies.data_parallel import gradient_collective
from fleetlike.strategies.recompute import apply_recompute, auto_checkpoints
from fleetlike.strategies.step import AppliedEntry

__all__ = ["PipelineModel", "StageModule", "freeze_heap"]

LossFn = Callable[[Any, Any], torch.Tensor]

#: whether this process has frozen its heap out of the garbage collector (`freeze_heap`)
_FROZEN: list[bool] = []


def freeze_heap() -> bool:
    """Collect once, then move every object alive now out of the garbage collector's reach
    (``gc.freeze``), once per process; True the first time.

    Why: a pipeline's stages wait on each other, so a stall on one stage idles its neighbour
    too. A full collection scans every tracked object -- torch's and the model's, hundreds of
    thousands after the imports -- and took 6.7-11.7 ms inside a step of the pipeline benchmark
    (140 ms in a process with fleetlike's whole API imported); after the freeze it scans only
    the objects made since (0.01 ms). Called after a pipelined model's first step, when the
    model, its optimizer state and the schedules exist. Objects frozen are still freed when
    their last reference goes; only cycles among them are no longer collected.

    Example:
        >>> freeze_heap()   # after the first train_batch
    """
    if _FROZEN:
        return False
    _FROZEN.append(True)
    gc.collect()
    gc.freeze()
    return True


class StageModule(torch.nn.Module):
    """One stage's blocks run in order (under AMP's autocast when on); ``names`` are the blocks'
    names in the unsplit model."""

    def __init__(self, blocks: tuple[tuple[str, torch.nn.Module], ...], amp_configs: Any = None) -> None:
        super().__init__()
        self.names = [name for name, _ in blocks]
        self.blocks = torch.nn.ModuleList(module for _, module in blocks)
        self.amp_configs = amp_configs

    def forward(self, x: Any) -> Any:
        if self.amp_configs is None:
            return self._run(x)
        device_type = x.device.type if isinstance(x, torch.Tensor) else "cpu"
        with amp_autocast(self.amp_configs, device_type):
            return self._run(x)

    def _run(self, x: Any) -> Any:
        for block in self.blocks:
            x = block(x)
        return x

    def named_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This stage's parameters and buffers under the unsplit model's names."""
        for name, block in zip(self.names, self.blocks):
            for key, value in block.state_dict(keep_vars=True).items():
                yield f"{name}.{key}", value


class PipelineModel(torch.nn.Module):
    """This rank's stage and the schedule around it; see the module docstring."""

    def __init__(self, model: torch.nn.Module, plan: StagePlan, hcg: HybridCommunicateGroup,
                 strategy: DistributedStrategy, loss_fn: LossFn | None, device: torch.device, store: Any) -> None:
        super().__init__()
        cfg = strategy.pipeline_configs
        self.hcg = hcg
        self.plan = plan
        self.strategy = strategy
        self.loss_fn = loss_fn
        self.device = device
        self.num_micro = int(cfg["accumulate_steps"])
        self.micro_batch_size = int(cfg["micro_batch_size"])
        self.schedule_mode = str(cfg["schedule_mode"])
        self.applied: list[AppliedEntry] = []
        self._freeze_heap = bool(cfg["freeze_heap"])
        self._heap_frozen = False  # `freeze_heap` called (or declined) and recorded after this model's first step
        p, stage_id = hcg.pp_degree, hcg.stage_id
        if self.schedule_mode == "1F1B" and self.num_micro < p:
            raise ValueError(
                f"pipeline_configs.accumulate_steps={self.num_micro} micro-batches is fewer than the "
                f"{p} stages, which schedule_mode='1F1B' needs (each stage warms up with one "
                f"micro-batch per later stage). Fix: accumulate_steps >= {p} (4 x {p} keeps the bubble "
                "small), or schedule_mode='FThenB'")
        if strategy.amp and str(strategy.amp_configs["dtype"]) == "float16":
            raise ValueError(
                "strategy.amp with amp_configs.dtype='float16' needs one loss scale agreed by every "
                "stage around the schedule, which the pipeline does not run. Fix: amp_configs.dtype = "
                "'bfloat16' (float32's range: no loss scale)")
        recompute = self._recompute_names(model, strategy)
        self.stage = StageModule(plan.stages[stage_id], strategy.amp_configs if strategy.amp else None)
        self._release_others(plan, stage_id)
        self.stage.to(device)
        tensors = [t for _, t in self.stage.named_state()]
        broadcast_coalesced(hcg.dp_comm, [t.data for t in tensors])  # replicas start equal
        self._buckets: list[Bucket] = []
        self._collective: Any = None
        if hcg.dp_degree > 1:
            self._collective, notes = gradient_collective(strategy, hcg.dp_groups, hcg.dp_role)
            layout = plan_buckets(list(self.stage.parameters()), strategy.bucket_cap_bytes())
            self._buckets = [Bucket(i, ps) for i, ps in enumerate(layout)]
            self.applied.append(AppliedEntry("data_parallel", True, (
                f"each stage's gradients averaged over the {hcg.dp_degree} pipelines once per step, "
                f"{len(self._buckets)} bucket(s) on this stage")))
            self.applied += [AppliedEntry(n, a, w) for n, a, w in notes]
        abort = [self._abort_pipe, hcg.dp_comm._abort, hcg.pp_comm._abort]
        self.guard = FailureGuard(store, hcg.global_rank, stage_id, abort)
        self._stages: dict[tuple[Any, ...], tuple[PipelineStage, Any]] = {}  # eval_batch's
        #: the training step's schedule (`fleetlike.pipeline.runner`)
        self.runner = StageRunner(self.stage, stage_id, p, self.num_micro, self.schedule_mode,
                                  hcg.get_pipe_parallel_process_group(),
                                  self._micro_loss, device)
        counts = plan.param_counts()
        self.applied.insert(0, AppliedEntry("pipeline", True, (
            f"{p} stages ({plan.how}; parameters per stage {counts}), {self.num_micro} micro-batches, "
            f"{'1F1B' if self.schedule_mode == '1F1B' else 'FThenB (GPipe)'}; this rank: stage {stage_id} "
            f"{self.stage.names}, pipeline {hcg.dp_rank} of {hcg.dp_degree}; handoffs: {hcg.p2p_transport}")))
        if recompute:
            mine = [n for n in recompute if any(n == b or n.startswith(b + ".") for b in self.stage.names)]
            self.applied.append(AppliedEntry("recompute", True, f"this stage recomputes {mine or 'nothing'}"))
        if strategy.amp:
            self.applied.append(AppliedEntry("amp", True, "bfloat16 autocast inside each stage"))

    # ---------------------------------------------------------------- building

    @staticmethod
    def _recompute_names(model: torch.nn.Module, strategy: DistributedStrategy) -> list[str]:
        if not strategy.recompute:
            return []
        wanted = strategy.recompute_configs["checkpoints"]
        names = auto_checkpoints(model) if wanted == "auto" else list(wanted)
        return apply_recompute(model, names) if names else []

    @staticmethod
    def _release_others(plan: StagePlan, stage_id: int) -> None:
        """Free the other stages' blocks: their tensors move to the meta device (no storage)."""
        for s, blocks in enumerate(plan.stages):
            if s != stage_id:
                for _, module in blocks:
                    module.to("meta")

    def _abort_pipe(self) -> None:
        pg = self.hcg.get_pipe_parallel_process_group()
        if pg is not None:
            pg.abort()

    def _schedule(self, micro: torch.Tensor, training: bool, with_loss: bool = True) -> tuple[PipelineStage, Any]:
        """The stage and schedule for micro-batches shaped like ``micro`` (torch's stage agrees
        the shapes between neighbours once, at its first step, so each shape gets its own)."""
        key = (tuple(micro.shape), micro.dtype, training, with_loss)
        found = self._stages.get(key)
        if found is None:
            hcg = self.hcg
            stage = PipelineStage(self.stage, hcg.stage_id, hcg.pp_degree, self.device,
                                  group=hcg.get_pipe_parallel_process_group())
            cls = Schedule1F1B if self.schedule_mode == "1F1B" else ScheduleGPipe
            loss = self._micro_loss if self.loss_fn is not None and with_loss else None
            found = (stage, cls(stage, self.num_micro, loss_fn=loss, scale_grads=True))
            self._stages[key] = found
        return found

    def _micro_loss(self, output: Any, target: Any) -> torch.Tensor:
        assert self.loss_fn is not None
        if self.stage.amp_configs is not None and isinstance(output, torch.Tensor) and output.is_floating_point():
            output = output.float()  # the loss in float32, as autocast computes losses
        loss = self.loss_fn(output, target)
        return loss.float() if loss.dtype != torch.float32 and loss.is_floating_point() else loss

    # ---------------------------------------------------------------- Paddle's calls

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "a pipelined model holds one stage, so model(x) has no meaning on its own. Fix: "
            "loss = model.train_batch((x, y), optimizer) to train, model.eval_batch((x, y)) to evaluate")

    def _split_batch(self, data: Any, what: str) -> tuple[torch.Tensor, Any]:
        if not isinstance(data, (tuple, list)) or len(data) != 2:
            raise TypeError(f"{what}: data must be (inputs, labels), a tuple or list of two, got "
                            f"{type(data).__name__}{'' if not isinstance(data, (tuple, list)) else f' of {len(data)}'}")
        x, y = data
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{what}: inputs must be a tensor (the first stage's input), got {type(x).__name__}")
        rows, m = x.shape[0], self.num_micro
        if self.micro_batch_size and rows != self.micro_batch_size * m:
            raise ValueError(
                f"{what}: the batch has {rows} rows, but pipeline_configs.micro_batch_size="
                f"{self.micro_batch_size} x accumulate_steps={m} = {self.micro_batch_size * m}. Fix: feed "
                f"batches of {self.micro_batch_size * m} rows, or set micro_batch_size=0 (rows / accumulate_steps)")
        if rows % m:
            raise ValueError(
                f"{what}: a batch of {rows} rows cannot be cut into pipeline_configs.accumulate_steps={m} "
                f"equal micro-batches. Fix: feed a multiple of {m} rows (e.g. {rows - rows % m or m})")
        return x.to(self.device), (y.to(self.device) if isinstance(y, torch.Tensor) else y)

    def train_batch(self, data: Any, optimizer: torch.optim.Optimizer, lr_scheduler: Any = None,
                    scaler: Any = None) -> torch.Tensor:
        """One optimizer step over the batch ``data = (x, y)``; the mean micro-batch loss on every
        rank of the pipeline (its own data's, as a data-parallel rank's loss is)."""
        if scaler is not None:
            raise ValueError("train_batch: a loss scaler needs one scale agreed by every stage, which the "
                             "pipeline does not run. Fix: pass scaler=None (bfloat16 AMP needs none)")
        if self.loss_fn is None:
            raise ValueError("train_batch needs the loss: fleet.distributed_model(model, loss_fn=...) "
                             "with loss_fn(output, labels) -> the mean loss of one micro-batch")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"train_batch: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        return self.guard.run(lambda: self._train(data, optimizer, lr_scheduler))

    def _train(self, data: Any, optimizer: torch.optim.Optimizer, lr_scheduler: Any) -> torch.Tensor:
        x, y = self._split_batch(data, "train_batch")
        self.stage.train()
        for p in self.stage.parameters():
            p.grad = None
        for bucket in self._buckets:  # gradients accumulate straight into the buckets
            bucket.zero_()
            bucket.attach()
        losses: list[torch.Tensor] = []
        hcg = self.hcg
        m = self.num_micro
        key = (tuple(x.shape), x.dtype)
        inputs = x.tensor_split(m) if hcg.is_first_stage() else None  # as torch's schedule splits
        targets = (y.tensor_split(m) if isinstance(y, torch.Tensor) else y) if hcg.is_last_stage() else None
        self.runner.step(inputs, targets, losses, key)
        loss = self._shared_loss(losses)  # before the update: the first stage finds it waiting
        self._average_gradients()
        if hasattr(optimizer, "pipelined"):  # fleet's DistributedOptimizer: its step is the wrapped one's
            optimizer.pipelined = True  # type: ignore[attr-defined]
        optimizer.step()
        if lr_scheduler is not None:
            lr_scheduler.step()
        if not self._heap_frozen:  # once per model: later steps pay nothing here
            self._heap_frozen = True
            self.applied.append(self._after_first_step())
        return loss

    def _after_first_step(self) -> AppliedEntry:
        """Freeze the heap (``pipeline_configs.freeze_heap``), and say what was done."""
        if not self._freeze_heap:
            return AppliedEntry("pipeline_gc", False, (
                "pipeline_configs.freeze_heap=False: the heap is left to the garbage collector "
                "(a full collection inside a step stalls this stage and its neighbour)"))
        freeze_heap()
        return AppliedEntry("pipeline_gc", True, (
            "after the first step the objects alive were frozen out of the garbage collector "
            "(gc.freeze; pipeline_configs.freeze_heap=False turns it off): a full collection, a "
            "stall its neighbour stage would wait out, then scans only newer objects"))

    def _average_gradients(self) -> None:
        if self._collective is None:
            return
        for bucket in self._buckets:
            bucket.attach()
        works = [self._collective.start(bucket) for bucket in self._buckets]
        for work in works:
            work.wait()

    def _shared_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The last stage's mean micro-batch loss, passed back stage by stage to the first.

        It rides the backward direction of the handoffs, after the step's last gradient (each
        stage receives it from the next and passes it to the one before): on shared memory a
        copy the first stage finds waiting when its last backward ends. A broadcast on the
        pipeline's group would ride gloo, a round of its threads on the first stage's critical
        path every step."""
        value = torch.zeros((), dtype=torch.float32, device=self.device)
        if losses:
            value = torch.stack([loss.detach().float().to(self.device) for loss in losses]).mean()
        if self.hcg.pp_degree > 1:
            self.runner.pass_back(value)
        return value.cpu()

    @torch.no_grad()
    def eval_batch(self, data: Any, compute_loss: bool = True) -> Any:
        """Forward only: the mean micro-batch loss (``compute_loss``) or the last stage's output,
        on every rank of the pipeline."""
        return self.guard.run(lambda: self._eval(data, compute_loss))

    def _eval(self, data: Any, compute_loss: bool) -> Any:
        x, y = self._split_batch(data, "eval_batch")
        if compute_loss and self.loss_fn is None:
            raise ValueError("eval_batch(compute_loss=True) needs fleet.distributed_model(model, loss_fn=...)")
        self.stage.eval()
        stage, schedule = self._schedule(x[: x.shape[0] // self.num_micro], False, compute_loss)
        hcg = self.hcg
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {}
        if hcg.is_last_stage() and compute_loss:
            kwargs = {"target": y, "losses": losses}
        out = schedule.eval(x, **kwargs) if hcg.is_first_stage() else schedule.eval(**kwargs)
        if compute_loss:
            return self._shared_loss(losses)
        box = [out.detach().cpu() if isinstance(out, torch.Tensor) else out]
        if hcg.pp_degree > 1:
            dist.broadcast_object_list(box, group_src=hcg.pp_degree - 1, group=hcg.get_pipe_parallel_process_group())
        return box[0]

    # ---------------------------------------------------------------- state

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """This stage's parameters and buffers under the unsplit model's names."""
        return {name: t.detach().clone() for name, t in self.stage.named_state()}

    def stage_names(self) -> list[str]:
        """The unsplit model's names of this stage's tensors."""
        return [name for name, _ in self.stage.named_state()]

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        """Load this stage's part of ``state_dict`` (this stage's, or a whole model's)."""
        mine = dict(self.stage.named_state())
        missing = [n for n in mine if n not in state_dict]
        if strict and missing:
            raise KeyError(f"load_state_dict: stage {self.hcg.stage_id} needs {missing[:6]}"
                           f"{' ...' if len(missing) > 6 else ''}, absent from the state given (keys like "
                           f"{list(state_dict)[:4]}). Fix: load this stage's file or a whole model's state")
        with torch.no_grad():
            for name, tensor in mine.items():
                if name in state_dict:
                    value = torch.as_tensor(state_dict[name])
                    if value.shape != tensor.shape:
                        raise ValueError(f"load_state_dict: {name} is {tuple(value.shape)} in the state "
                                         f"given, {tuple(tensor.shape)} in the model")
                    tensor.copy_(value)
        return torch.nn.modules.module._IncompatibleKeys(missing, [])

    def _full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """Every stage's tensors under the unsplit model's names (collective over the pipeline;
        every pipeline holds the same values). ``rank0_only``: empty on other ranks."""
        mine = {name: t.detach().cpu().clone() for name, t in self.stage.named_state()}
        parts: list[Any] = [None] * self.hcg.pp_degree
        if self.hcg.pp_degree > 1:
            dist.all_gather_object(parts, mine, group=self.hcg.get_pipe_parallel_process_group())
        else:
            parts = [mine]
        if rank0_only and self.hcg.global_rank != 0:
            return {}
        full: dict[str, torch.Tensor] = {}
        for part in parts:
            full.update(part)
        return full

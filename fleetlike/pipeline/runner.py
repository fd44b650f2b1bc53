"""`StageRunner`: one stage's side of a pipelined training step, 1F1B or GPipe, run by fleetlike
instead of torch's ``Schedule1F1B`` / ``ScheduleGPipe``.

Why: torch's schedule spends about half a millisecond of Python between one op and the next on
a stage (``python -m bench.pipeline``: *between two forwards* on stage 0 under GPipe, where it
waits for nobody) -- building ``P2POp`` lists, ``batch_isend_irecv``, flattening arguments,
formatting debug strings it then does not log -- and at 2 stages under 1F1B that time lands on
the pipeline's step once per micro-batch, beyond the bubble (p-1)/(m+p-1). Here each micro-batch
is: receive into a buffer made once per batch shape (rotating over the micro-batches that can
be in flight at once), run the stage, send; on the shared-memory transport the send and the
receive call the ring backend directly (`fleetlike.comm.torch_shm.ShmProcessGroup`), past
``torch.distributed``'s wrappers. The arithmetic is torch's, op for op in the same order (each
micro-batch's loss or output gradient backpropagated, the gradients summed over the
micro-batches, then divided by their number), so the result equals torch's schedule bit for
bit (``tests/test_pipeline_shm.py``).

The shapes are agreed once per batch shape: a stage sends the next one its output's shape and
dtype (an object message) before its first activation of that shape; the gradients coming back
have the shape of what was sent.

Example:
    >>> runner = StageRunner(stage_module, stage_id, pp, m, "1F1B", pipe_group, loss_fn)
    >>> losses = []
    >>> runner.step(x.chunk(m) if first else None, y.chunk(m) if last else None, losses)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fleetlike.comm.torch_shm import ShmProcessGroup

__all__ = ["StageRunner", "op_order"]

_TAG = 0  # one kind of message per direction: activations forward, gradients back


def op_order(schedule_mode: str, num_micro: int, num_stages: int, stage_id: int) -> list[tuple[str, int]]:
    """The order of ``stage_id``'s forwards ("F") and backwards ("B") of micro-batches 0..m-1 in
    one step, as torch's schedules run them: GPipe ("FThenB") every forward, then every
    backward; 1F1B ``min(m, p - stage)`` warm-up forwards, then a backward and a forward in turn,
    then the remaining backwards. Why a function: a model of the schedule (a replay of its
    timeline) must run the same order as the step itself.

    Example:
        >>> op_order("1F1B", 4, 2, 0)
        [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('F', 3), ('B', 2), ('B', 3)]
    """
    if schedule_mode != "1F1B":
        return [("F", i) for i in range(num_micro)] + [("B", i) for i in range(num_micro)]
    warm = min(num_micro, num_stages - stage_id)
    order = [("F", i) for i in range(warm)]
    f = warm
    for b in range(num_micro):
        order.append(("B", b))
        if f < num_micro:
            order.append(("F", f))
            f += 1
    return order


class _Link:
    """Point-to-point with the neighbouring stages on the pipeline's process group (group rank =
    stage id); through the ring backend's own calls when the group is of ``fleetlike_shm``."""

    def __init__(self, group: Any, device: torch.device) -> None:
        self.group = group
        # a group of the ring backend is the backend's own object (``dist.new_group`` returns it)
        self.direct: ShmProcessGroup | None = group if isinstance(group, ShmProcessGroup) else None

    def send(self, tensor: torch.Tensor, peer: int) -> Any:
        """Start sending ``tensor`` to stage ``peer``; the work to wait on."""
        if self.direct is not None:
            return self.direct.send([tensor], peer, _TAG)
        return dist.isend(tensor, group=self.group, group_dst=peer, tag=_TAG)

    def recv(self, tensor: torch.Tensor, peer: int) -> None:
        """Receive stage ``peer``'s next message into ``tensor``."""
        if self.direct is not None:
            self.direct.recv([tensor], peer, _TAG).wait()
            return
        work = dist.irecv(tensor, group=self.group, group_src=peer, tag=_TAG)
        if work is not None:
            work.wait()

    def send_object(self, obj: Any, peer: int) -> None:
        dist.send_object_list([obj], group_dst=peer, group=self.group)

    def recv_object(self, peer: int) -> Any:
        box: list[Any] = [None]
        dist.recv_object_list(box, group_src=peer, group=self.group)
        return box[0]


class _Shapes:
    """What one batch shape needs on this stage: the input's and output's (shape, dtype) and
    the receive buffers, made at the first step of that shape and kept for the next."""

    def __init__(self) -> None:
        self.inputs: list[torch.Tensor] = []  # activation buffers, rotated over the micro-batches
        self.out_meta: tuple[tuple[int, ...], torch.dtype] | None = None
        self.grad: torch.Tensor | None = None  # the output gradient's buffer


class StageRunner:
    """This stage's forwards and backwards of one step in the order of torch's 1F1B or GPipe;
    see the module docstring."""

    def __init__(self, module: torch.nn.Module, stage_id: int, num_stages: int, num_micro: int,
                 schedule_mode: str, group: Any, loss_fn: Callable[[Any, Any], torch.Tensor] | None,
                 device: torch.device) -> None:
        self.module = module
        self.stage_id, self.num_stages, self.num_micro = stage_id, num_stages, num_micro
        self.one_f_one_b = schedule_mode == "1F1B"
        self.loss_fn = loss_fn
        self.device = device
        self.first, self.last = stage_id == 0, stage_id == num_stages - 1
        self.link = _Link(group, device) if num_stages > 1 else None
        # activations this stage holds at once: 1F1B's warm-up depth, GPipe's every micro-batch
        self.in_flight = min(num_micro, num_stages - stage_id) if self.one_f_one_b else num_micro
        self._shapes: dict[tuple[Any, ...], _Shapes] = {}

    # ---------------------------------------------------------------- one step

    def step(self, inputs: Sequence[torch.Tensor] | None, targets: Sequence[Any] | None,
             losses: list[torch.Tensor], key: tuple[Any, ...]) -> None:
        """Run this stage's part of one step over ``num_micro`` micro-batches: ``inputs`` (the
        first stage's micro-batches), ``targets`` (the last stage's), the last stage's loss of
        each appended to ``losses``; every gradient summed into ``.grad`` and divided by the
        number of micro-batches. ``key`` names the batch shape (its buffers and agreed shapes)."""
        shapes = self._shapes.get(key)
        if shapes is None:
            shapes = self._shapes[key] = _Shapes()
        m = self.num_micro
        held: list[tuple[Any, Any, torch.Tensor | None]] = [(None, None, None)] * m  # (input, output, loss)
        sends: list[tuple[Any, torch.Tensor]] = []
        for kind, i in op_order("1F1B" if self.one_f_one_b else "FThenB", m, self.num_stages, self.stage_id):
            if kind == "F":
                held[i] = self._forward(i, shapes, inputs, targets, losses, sends)
            else:
                self._backward(i, shapes, held[i], sends)
                held[i] = (None, None, None)
        for work, _ in sends:
            if work is not None:
                work.wait()
        for p in self.module.parameters():  # the micro-batches' mean, as torch's scale_grads
            if p.grad is not None:
                p.grad.div_(m)

    def _forward(self, i: int, shapes: _Shapes, inputs: Sequence[torch.Tensor] | None,
                 targets: Sequence[Any] | None, losses: list[torch.Tensor],
                 sends: list[tuple[Any, torch.Tensor]]) -> tuple[Any, Any, torch.Tensor | None]:
        if self.first:
            assert inputs is not None
            x: Any = inputs[i]
        else:
            x = self._input_buffer(i, shapes)
            self._recv(x, self.stage_id - 1, "fwd_recv")
        out = self.module(x)
        if self.last:
            if self.loss_fn is None or targets is None:
                raise RuntimeError(f"the last pipeline stage needs the loss function and the labels to train "
                                   f"(loss_fn {'set' if self.loss_fn else 'None'}, labels "
                                   f"{'given' if targets is not None else 'None'})")
            loss = self.loss_fn(out, targets[i])
            losses.append(loss.detach())
            return x, out, loss
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"pipeline stage {self.stage_id} returned a {type(out).__name__}; a stage hands one tensor "
                f"to the next. Fix: make the block before split point {self.stage_id + 1} return one tensor")
        if not out.requires_grad:
            raise RuntimeError(
                f"pipeline stage {self.stage_id}'s output does not require grad (no parameter of the stage "
                "or before it is trained): there is no gradient to send back. Fix: train a parameter of "
                "this stage, or split the model after a trained block")
        if shapes.out_meta is None:  # the next stage learns the shape once
            shapes.out_meta = (tuple(out.shape), out.dtype)
            self.link.send_object(shapes.out_meta, self.stage_id + 1)  # type: ignore[union-attr]
        elif (tuple(out.shape), out.dtype) != shapes.out_meta:
            raise RuntimeError(
                f"pipeline stage {self.stage_id}: micro-batch {i}'s output is {tuple(out.shape)} {out.dtype}, "
                f"the first's was {shapes.out_meta[0]} {shapes.out_meta[1]}: every micro-batch of a shape "
                "must give the same output shape")
        payload = out.detach()
        sends.append((self.link.send(payload, self.stage_id + 1), payload))  # type: ignore[union-attr]
        return x, out, None

    def _backward(self, i: int, shapes: _Shapes, held: tuple[Any, Any, torch.Tensor | None],
                  sends: list[tuple[Any, torch.Tensor]]) -> None:
        x, out, loss = held
        if self.last:
            torch.autograd.backward([loss])
        else:
            if shapes.grad is None:
                assert shapes.out_meta is not None
                shapes.grad = torch.empty(shapes.out_meta[0], dtype=shapes.out_meta[1], device=self.device)
            grad = shapes.grad
            self._recv(grad, self.stage_id + 1, "bwd_recv")
            torch.autograd.backward([out], grad_tensors=[grad])
        if not self.first:
            g = x.grad
            x.grad = None
            if g is None:  # the output does not depend on this input: its gradient is zero
                g = torch.zeros_like(x)
            sends.append((self.link.send(g, self.stage_id - 1), g))  # type: ignore[union-attr]

    def pass_back(self, value: torch.Tensor) -> None:
        """The last stage's ``value`` (overwritten in place on the others), handed from each
        stage to the one before it: the step's loss to every stage, behind the gradients."""
        if not self.last:
            self._recv(value, self.stage_id + 1, "loss_recv")
        if not self.first:
            self.link.send(value, self.stage_id - 1).wait()  # type: ignore[union-attr]

    # ---------------------------------------------------------------- receiving

    def _recv(self, into: torch.Tensor, peer: int, kind: str) -> None:
        """Wait for stage ``peer``'s next message into ``into`` (``kind``: ``fwd_recv`` for an
        activation, ``bwd_recv`` for a gradient: what a timing wrapper reads)."""
        self.link.recv(into, peer)  # type: ignore[union-attr]

    def _input_buffer(self, i: int, shapes: _Shapes) -> torch.Tensor:
        """The buffer micro-batch ``i``'s activation is received into: one per micro-batch that
        can be in flight, so a buffer is reused only after its earlier micro-batch's backward."""
        if not shapes.inputs:
            shape, dtype = self.link.recv_object(self.stage_id - 1)  # type: ignore[union-attr]
            shapes.inputs = [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(self.in_flight)]
        buf = shapes.inputs[i % self.in_flight]
        buf.requires_grad_(buf.is_floating_point() or buf.is_complex())
        return buf

"""`SavedBytesMeter`: the bytes autograd keeps saved, live, counted against `activation_bytes`
(the planner's count of one forward, other code) and released when autograd drops them, after a
backward or with a graph never used, a reset leaving the new counts alone whatever the graphs
saved before it do later."""

from __future__ import annotations

import gc
import weakref

import torch

from fleetlike.plan.memory import activation_bytes
from fleetlike.plan.saved import Metered, SavedBytesMeter


def _blocks() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU()), torch.nn.Linear(128, 32)]


def _metered(meter: SavedBytesMeter) -> torch.nn.Sequential:
    net = torch.nn.Sequential(*[Metered(b, meter) for b in _blocks()])
    meter.params = {p.untyped_storage().data_ptr() for p in net.parameters()}
    return net


def test_one_forward_reads_what_the_planner_counts_and_a_backward_releases_it() -> None:
    x = torch.randn(16, 64)
    plain = torch.nn.Sequential(*_blocks())
    with activation_bytes(plain, skip=(x,)) as counter:
        plain(x).sum().backward()
    meter = SavedBytesMeter()
    net = _metered(meter)
    meter.params.add(x.untyped_storage().data_ptr())
    meter.enabled = True
    out = net(x)
    assert counter.total > 0 and meter.peak == counter.total
    assert sum(meter.live.values()) == counter.total
    out.sum().backward()  # autograd frees the saved tensors: the holders go with them
    gc.collect()
    assert meter.live == {} and meter.refs == {}
    assert meter.peak == counter.total


def test_a_graph_from_before_a_reset_leaves_the_new_counts_alone() -> None:
    meter = SavedBytesMeter()
    net = _metered(meter)
    x = torch.randn(8, 64)  # not left out: both forwards save this storage
    meter.enabled = True
    old = net(x)
    meter.reset()
    new = net(x)
    counted = dict(meter.live)
    assert x.untyped_storage().data_ptr() in counted
    del old  # its graph, and what it saved before the reset, dies now
    gc.collect()
    assert meter.live == counted and meter.peak == sum(counted.values())
    del new
    gc.collect()
    assert meter.live == {}


def test_a_forward_dropped_without_backward_is_released_with_what_it_saved() -> None:
    """ReLU and sigmoid save their own outputs: the meter must not tie them into a cycle."""
    meter = SavedBytesMeter()
    torch.manual_seed(0)
    net = torch.nn.Sequential(Metered(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                                          torch.nn.Linear(64, 64), torch.nn.Sigmoid()), meter))
    meter.params = {p.untyped_storage().data_ptr() for p in net.parameters()}
    x = torch.randn(8, 64)
    meter.params.add(x.untyped_storage().data_ptr())
    meter.enabled = True
    out = net(x)
    assert sum(meter.live.values()) == 2 * out.numel() * out.element_size()  # ReLU's and sigmoid's outputs
    alive = weakref.ref(out)
    del out
    gc.collect()
    assert alive() is None and meter.live == {}
    out = net(x)  # and the gradients through the detached copies are autograd's own
    (got,) = torch.autograd.grad(out.sum(), [net[0].block[0].weight])
    meter.enabled = False
    (want,) = torch.autograd.grad(net(x).sum(), [net[0].block[0].weight])
    assert torch.equal(got, want)

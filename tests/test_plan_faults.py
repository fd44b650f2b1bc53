"""The planner's clock without page faults takes off the faults of the traced thread's work only:
its own and its intra-op helpers', never another Python thread's (which made an op read ~0 while
another thread of the process faulted)."""

from __future__ import annotations

import mmap
import threading
import time

import torch

from fleetlike.plan.dry import DryFabric
from fleetlike.plan.faults import work_faults
from fleetlike.plan.spec import ModelSpec, model_work

PAGES = 256


def _fault_in(pages: int) -> None:
    m = mmap.mmap(-1, pages * mmap.PAGESIZE)
    try:
        torch.frombuffer(m, dtype=torch.uint8).fill_(1)  # every page faulted in
    finally:
        m.close()


def _touch(pages: int) -> None:
    """Fault in ``pages`` fresh pages on the calling thread alone (no torch op: no intra-op pool)."""
    m = mmap.mmap(-1, pages * mmap.PAGESIZE)
    try:
        for i in range(pages):
            m[i * mmap.PAGESIZE] = 1
    finally:
        m.close()


def _while_another_thread_faults(measure) -> float:
    """``measure(work)`` while another thread of this process faults in ``PAGES`` fresh pages."""
    started, done = threading.Event(), threading.Event()

    def other() -> None:
        started.wait(10)
        _touch(PAGES)
        done.set()

    t = threading.Thread(target=other)
    t.start()
    try:
        return measure(lambda: (started.set(), done.wait(10), time.sleep(0.01)))
    finally:
        t.join(10)


def test_another_threads_faults_are_not_taken_off_an_interval() -> None:
    fabric = DryFabric(1)
    fabric.fault_seconds = 1.0  # a second per fault: any fault counted shows

    def measure(work) -> float:
        t0 = fabric.now()
        work()
        return fabric.now() - t0

    elapsed = _while_another_thread_faults(measure)
    assert 0.0 < elapsed < 10.0, elapsed  # with the whole process's faults: about -PAGES


def test_model_work_leaves_another_threads_faults_in_place() -> None:
    def loss(net: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return _while_another_thread_faults(lambda work: (work(), net(x).sum())[1])

    spec = ModelSpec(lambda batch: (torch.nn.Linear(4, 4), loss, torch.ones(batch, 4)), batch_size=2)
    # a millisecond per fault: the other thread's take off 0.26 s, more than the run lasts
    run = model_work(spec, time.perf_counter, fault_seconds=1e-3)
    run(), run()  # the gradients and the harness's own memory allocated
    assert run() > 0.0  # with the whole process's faults: 0


def test_the_faults_of_the_threads_running_the_calling_threads_ops_count() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the fill is split over the intra-op pool: half its pages are not ours
    try:
        _fault_in(PAGES)  # the pool started
        f0 = work_faults()
        _fault_in(PAGES)
        assert work_faults() - f0 >= PAGES, work_faults() - f0
    finally:
        torch.set_num_threads(threads)

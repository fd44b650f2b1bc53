"""How long another launcher stood still, as a launcher's watch measures it on a busy machine.

A launcher's watch (`fleetlike.launch.nodewatch.NodeWatch`) reads the other launchers' beats on
the store once a period. Another launcher whose beat stood still for more than `MISSED` periods
and then moved (stopped with SIGSTOP and continued) is summarised as having stopped answering,
and for how long. The silence is measured between two reads of the store: from the end of the
look that first read the beat to the start of the last look that read it unchanged. So the
watch's own looks may come late (a loaded machine starves its thread, right when the stopped
launcher's processes resume and take the CPU) without losing the other's silence, and a pause
of the watch itself is never blamed on the other launcher. The clock is the test's: each look
is placed exactly where the case needs it.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from fleetlike.launch import nodewatch
from fleetlike.launch.nodewatch import BEAT_PREFIX, MISSED, NODES_KEY, PERIOD, NodeWatch

pytestmark = pytest.mark.timeout(30)

OTHER = "127.0.0.2"


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def watch(monkeypatch: pytest.MonkeyPatch) -> tuple[NodeWatch, dist.Store, _Clock]:
    store = dist.HashStore()
    for n, ip in enumerate(("127.0.0.1", OTHER), start=1):
        store.set(f"{NODES_KEY}/{n}", ip)
        store.set(BEAT_PREFIX + ip, "0 up")
    store.add(NODES_KEY, 2)
    clock = _Clock()
    monkeypatch.setattr(nodewatch.time, "monotonic", clock)
    return NodeWatch("127.0.0.1:1", "127.0.0.1", store=store), store, clock


def _looks(watch: NodeWatch, store: dist.Store, clock: _Clock, plan: list[tuple[float, str | None]]) -> str:
    """Each step: the clock moves by ``dt``, the other launcher writes ``beat`` (None: nothing),
    the watch looks. Returns why the other launcher would be summarised as lost."""
    for dt, beat in plan:
        clock.now += dt
        if beat is not None:
            store.set(BEAT_PREFIX + OTHER, beat)
        watch._look()
    return watch._why(OTHER, clock.now)


def test_a_silence_is_kept_when_the_look_that_sees_the_beat_move_again_comes_late(watch) -> None:
    """The other launcher beats, stands still for 8 looks on time, then beats again just as this
    watch's thread is starved for 4 s: the silence read by the on-time looks (8 s) is kept."""
    w, store, clock = watch
    plan = [(0.0, None), (PERIOD, "1 up")] + [(PERIOD, None)] * 8 + [(4 * PERIOD, "2 up")]
    why = _looks(w, store, clock, plan)
    assert why == ("its launcher stopped answering for 8 s: stopped (SIGSTOP), paused or cut off, "
                   "then answered again")


def test_a_pause_of_the_watch_itself_is_never_the_other_launchers(watch) -> None:
    """This watch stands still for 6 s while the other launcher beats every second: the next
    look finds the beat moved, and nothing is blamed on the other launcher."""
    w, store, clock = watch
    why = _looks(w, store, clock, [(0.0, None), (PERIOD, "1 up"), (6 * PERIOD, "7 up"), (PERIOD, "8 up")])
    assert why == "its launcher still answers: its workers left the world"
    assert OTHER not in w._silent


def test_short_gaps_and_a_launcher_that_beats_on_time_are_not_silences(watch) -> None:
    """Beats on time, then a gap of exactly `MISSED` periods read by on-time looks: no silence."""
    w, store, clock = watch
    plan = [(0.0, None)] + [(PERIOD, f"{n} up") for n in range(1, 5)] + [(PERIOD, None)] * MISSED
    plan.append((PERIOD, "9 up"))
    assert _looks(w, store, clock, plan) == "its launcher still answers: its workers left the world"
    assert OTHER not in w._silent


class _Stops:
    """A watch's ``_stopping`` whose waits move the test's clock: ``gaps`` are how long each
    wait takes (a launcher stopped with SIGSTOP inside one: its clock ran on); then it stops."""

    def __init__(self, clock: _Clock, gaps: list[float]) -> None:
        self.clock, self.gaps = clock, list(gaps)

    def wait(self, timeout: float) -> bool:
        if not self.gaps:
            return True
        self.clock.now += self.gaps.pop(0)
        return False

    def set(self) -> None:
        self.gaps = []


def test_a_launcher_that_was_stopped_says_so_in_its_beats_when_no_look_fell_inside(watch) -> None:
    """The other launcher is stopped for 12 s while this watch does not look at all (its thread
    blocked too): the other's own next beats say how long it stood still, and this watch's first
    look after it reports that silence."""
    w, store, clock = watch
    other = NodeWatch("127.0.0.1:1", OTHER, store=store)
    other._stopping = _Stops(clock, [PERIOD, PERIOD, 12 * PERIOD, PERIOD])  # type: ignore[assignment]
    _looks(w, store, clock, [(0.0, None)])
    other.start()
    other.join(10)
    assert store.get(BEAT_PREFIX + OTHER).decode() == "4 up silent 11.0"
    other.finish(0)
    assert store.get(BEAT_PREFIX + OTHER).decode() == "5 done 0 silent 11.0"
    why = _looks(w, store, clock, [(PERIOD, None)])
    assert why == ("its launcher stopped answering for 11 s: stopped (SIGSTOP), paused or cut off, "
                   "then answered again")


def test_a_launcher_on_time_appends_nothing_and_odd_reports_count_for_nothing(watch) -> None:
    w, store, clock = watch
    other = NodeWatch("127.0.0.1:1", OTHER, store=store)
    other._stopping = _Stops(clock, [PERIOD] * 5 + [PERIOD * (MISSED + 1)])  # type: ignore[assignment]
    other.run()
    assert store.get(BEAT_PREFIX + OTHER).decode() == "6 up"
    for beat in ("7 up silent", "8 up silent x", "9 up silent nan", "10 up silent 2.0"):
        why = _looks(w, store, clock, [(PERIOD, beat)])
        assert why == "its launcher still answers: its workers left the world", beat

"""The chaos soak's fault schedule (scripts/chaos_soak.py): every kind comes once per cycle, a fault
without effect is tried again, the window stays open while a kind is short, and a soak that missed a
kind reports ok: false."""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("chaos_soak", ROOT / "scripts/chaos_soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["chaos_soak"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("chaos_soak", None)


def drive(schedule, usable=lambda k: True, hit=lambda k: True, faults=12):
    """Inject `faults` faults back to back, as the soak does when each is due; the kinds that hit."""
    now, kinds = 0.0, []
    while len(kinds) < faults:
        now = max(now, schedule.due_at)
        kind = schedule.pick(usable)
        if kind is None:
            schedule.retry(now)
            continue
        schedule.injected(kind, hit(kind), now)
        if hit(kind):
            kinds.append(kind)
    return kinds


@pytest.mark.parametrize("seed", range(20))
def test_every_kind_comes_once_in_each_cycle_of_the_schedule(soak, seed):
    schedule = soak.Schedule(soak.FAULTS, random.Random(seed), (15.0, 30.0), 2, now=0.0)
    kinds = drive(schedule, faults=2 * len(soak.FAULTS))
    n = len(soak.FAULTS)
    assert sorted(kinds[:n]) == sorted(soak.FAULTS) and sorted(kinds[n:]) == sorted(soak.FAULTS)
    assert schedule.missing() == {}


def test_the_clock_is_one_for_the_soak_and_the_gaps_are_drawn_in_range(soak):
    schedule = soak.Schedule(soak.FAULTS, random.Random(3), (15.0, 30.0), 1, now=100.0)
    assert 115.0 <= schedule.due_at <= 130.0 and not schedule.due(114.0) and schedule.due(130.0)
    schedule.injected(schedule.pick(lambda k: True), True, 200.0)
    assert 215.0 <= schedule.due_at <= 230.0


def test_a_kind_that_cannot_hit_yet_waits_in_its_cycle_and_comes_later(soak):
    """corrupt_newest needs an older checkpoint, a kill a live actor: the cycle moves on and keeps it."""
    ready = {"corrupt_newest": False}
    schedule = soak.Schedule(soak.FAULTS, random.Random(0), (15.0, 30.0), 1, now=0.0)
    first = drive(schedule, usable=lambda k: ready.get(k, True), faults=len(soak.FAULTS) - 1)
    assert "corrupt_newest" not in first and schedule.missing() == {"corrupt_newest": 1}
    assert schedule.pick(lambda k: ready.get(k, True)) is None       # nothing else is left in the cycle
    ready["corrupt_newest"] = True
    assert drive(schedule, faults=1) == ["corrupt_newest"] and schedule.missing() == {}


def test_a_fault_without_effect_is_not_counted_and_is_tried_again_soon(soak):
    schedule = soak.Schedule(("kill_engine", "sigterm_driver"), random.Random(0), (15.0, 30.0), 1, now=0.0)
    kind = schedule.pick(lambda k: True)
    schedule.injected(kind, False, 50.0)               # the pid was gone already
    assert schedule.missing() == {"kill_engine": 1, "sigterm_driver": 1}
    assert schedule.due_at == 50.0 + soak.RETRY_S and schedule.pick(lambda k: True) == kind


def args(**over):
    base = dict(minutes=5.0, seed=0, out="/tmp/unused-chaos", fault_every=(15.0, 30.0), num_rollout=40,
                min_gain=0.15, min_each=1, max_extra_minutes=10.0)
    return argparse.Namespace(**{**base, **over})


def test_the_window_stays_open_while_a_kind_is_short_and_closes_at_the_limit(soak, monkeypatch):
    s = soak.Soak(args(minutes=1.0, max_extra_minutes=2.0))
    s.schedule = soak.Schedule(("kill_engine",), random.Random(0), (15.0, 30.0), 1, now=s.t0)
    clock = [s.t0 + 90.0]                               # past the 1-minute window
    monkeypatch.setattr(soak.time, "monotonic", lambda: clock[0])
    assert s.in_window()                                # kill_engine has not run: still open
    clock[0] = s.t0 + 181.0
    assert not s.in_window()                            # past the 2 extra minutes: closed, kind still missing
    clock[0] = s.t0 + 90.0
    s.schedule.injected("kill_engine", True, clock[0])
    assert not s.in_window()                            # every kind ran: the window is over


def test_a_soak_that_missed_a_kind_reports_not_ok(soak):
    s = soak.Soak(args())
    s.disk = Path("/tmp")                               # as if the save disk had been mounted
    kinds = soak.FAULTS
    s.schedule = soak.Schedule(kinds, random.Random(0), (15.0, 30.0), 1, now=s.t0)
    for k in kinds:
        if k != "sigterm_driver":
            s.schedule.hits[k] = 1
            s.faults.append(soak.Fault(1.0, k, 0, 0, "", True))
    s.faults.append(soak.Fault(2.0, "kill_engine", 0, 0, "pid 1 (gone already)", False))
    report = s.report()
    assert report["ok"] is False and report["kinds_missing"] == {"sigterm_driver": 1}
    assert report["faults_by_kind"]["sigterm_driver"] == 0 and report["faults_by_kind"]["kill_engine"] == 1
    assert report["faults_missed"] == 1 and report["faults_injected"] == len(kinds) - 1
    s.schedule.hits["sigterm_driver"] = 1
    assert s.report()["ok"] is True                     # the same soak with every kind run holds


def test_a_soak_without_its_save_disk_is_not_ok(soak):
    """enospc_save left out (not root) did not run: said, and the soak does not call itself ok."""
    s = soak.Soak(args())
    s.disk, s.disk_why = None, "mounting a tmpfs needs root"
    kinds = tuple(k for k in soak.FAULTS if k != "enospc_save")
    s.schedule = soak.Schedule(kinds, random.Random(0), (15.0, 30.0), 1, now=s.t0)
    s.schedule.hits.update({k: 1 for k in kinds})
    report = s.report()
    assert report["ok"] is False and report["kinds_missing"] == {"enospc_save": 1}
    assert report["enospc"].startswith("left out: mounting a tmpfs needs root")

"""rollout.scheduler: slot allocation, FIFO admission, prefix refcounts, drain-on-swap, capacity errors,
checked by hand on small cases (no engine)."""

from __future__ import annotations

import pytest

from rollout.scheduler import Admit, Scheduler


def slots_of(admits):
    return [(a.group, a.sample, a.slot) for a in admits]


def test_admission_fills_lowest_slots_in_fifo_order_and_splits_a_group():
    s = Scheduler(slots=4, max_inflight_groups=3, version=7)
    s.submit("a", 3)
    s.submit("b", 2)
    got = s.admit()
    # a takes slots 0-2 (its prefix is freed at its last admission), b starts with one sample in slot 3.
    assert got == [
        Admit("a", 0, 0, start=True, frees_prefix=False),
        Admit("a", 1, 1, start=False, frees_prefix=False),
        Admit("a", 2, 2, start=False, frees_prefix=True),
        Admit("b", 0, 3, start=True, frees_prefix=False),
    ]
    assert s.admit() == [] and s.free_slots == 0
    assert s.prefix_refs("a") == 0 and s.prefix_refs("b") == 1 and s.held_prefixes == ["b"]
    f = s.finish(1)
    assert (f.group, f.sample, f.group_done) == ("a", 1, False)
    # The freed slot 1 goes to b's waiting sample (a started group comes before any new one).
    s.submit("c", 1)
    assert slots_of(s.admit()) == [("b", 1, 1)]
    assert s.prefix_refs("b") == 0 and s.held_prefixes == []
    assert s.group_version("b") == 7


def test_a_group_is_emitted_when_its_last_sample_finishes_and_frees_its_place():
    s = Scheduler(slots=2, max_inflight_groups=1, version=1)
    s.submit("a", 3)
    assert not s.can_submit()
    with pytest.raises(ValueError, match="1 groups in flight = max_inflight_groups=1"):
        s.submit("b", 1)
    assert slots_of(s.admit()) == [("a", 0, 0), ("a", 1, 1)]
    assert s.finish(0).group_done is False
    assert slots_of(s.admit()) == [("a", 2, 0)]
    assert s.finish(1).group_done is False
    assert s.finish(0).group_done is True
    assert s.idle and s.can_submit() and s.busy_slots == []
    s.submit("b", 1)  # room again


def test_drain_on_swap_finishes_started_groups_then_starts_queued_ones_under_the_new_version():
    s = Scheduler(slots=2, max_inflight_groups=3, version=1)
    s.submit("a", 3)
    assert slots_of(s.admit()) == [("a", 0, 0), ("a", 1, 1)]
    s.submit("b", 2)
    s.request_swap()
    with pytest.raises(ValueError, match=r"swap to v2 refused: 2 slot\(s\) busy and 1 prefix\(es\) held under v1"):
        s.swap(2)
    s.finish(0)
    # Draining: a (started under v1, prefix still held) keeps being admitted; b does not start.
    assert slots_of(s.admit()) == [("a", 2, 0)]
    s.finish(1)
    assert s.admit() == [] and not s.drained
    s.finish(0)
    assert s.drained and s.busy_slots == [] and s.held_prefixes == []
    s.swap(2)
    got = s.admit()
    assert slots_of(got) == [("b", 0, 0), ("b", 1, 1)] and got[0].start
    assert s.group_version("b") == 2 and not s.drained


def test_an_in_flight_swap_keeps_started_groups_running_and_starts_new_ones_under_the_new_version():
    s = Scheduler(slots=2, max_inflight_groups=3, version=1)
    s.submit("a", 3)
    assert slots_of(s.admit()) == [("a", 0, 0), ("a", 1, 1)]
    s.submit("b", 1)
    s.swap(2, inflight=True)  # rule 6: 2 slots busy and a's prefix held, and yet
    assert s.version == 2 and not s.drained and s.busy_slots == [0, 1] and s.held_prefixes == ["a"]
    assert s.group_version("a") == 1  # the version it started under
    s.finish(0)
    assert slots_of(s.admit()) == [("a", 2, 0)]  # a's last sample, from its v1 prefix
    s.finish(1)
    got = s.admit()
    assert slots_of(got) == [("b", 0, 1)] and got[0].start and s.group_version("b") == 2


def test_cancel_swap_resumes_with_the_current_version_and_no_version_admits_nothing():
    s = Scheduler(slots=1, max_inflight_groups=2)
    s.submit("a", 1)
    assert s.admit() == []  # no policy loaded yet
    s.swap(3)  # nothing started: drained
    s.request_swap()
    assert s.admit() == []
    s.cancel_swap()
    assert slots_of(s.admit()) == [("a", 0, 0)] and s.group_version("a") == 3


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="slots=0, max_inflight_groups=1"):
        Scheduler(slots=0, max_inflight_groups=1)
    s = Scheduler(slots=2, max_inflight_groups=2, version=0)
    s.submit("a", 1)
    with pytest.raises(ValueError, match="already in flight"):
        s.submit("a", 1)
    with pytest.raises(ValueError, match="n_samples=0"):
        s.submit("b", 0)
    with pytest.raises(ValueError, match="slot 1 is not busy"):
        s.finish(1)
    with pytest.raises(ValueError, match="slot 5 is not busy"):
        s.finish(5)

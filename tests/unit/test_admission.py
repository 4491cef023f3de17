"""trainer.admission: stale and fingerprint drops, incomplete groups held, surplus groups kept, by hand."""

from __future__ import annotations

import numpy as np
import pytest

from broker.codec import Trajectory
from broker.streams import TrajectoryRecord
from trainer.admission import FINGERPRINT, STALE, Backlog, admit

FP = "f" * 64


def rec(
    group: str, index: int, *, version: int = 5, size: int = 2, fp: str = FP, tokens: list[int] | None = None
) -> TrajectoryRecord:
    """A sample of `group`; `tokens`: its token versions (the last is its policy_version), else one token at `version`."""
    tokens = tokens or [version]
    t = Trajectory(
        sample_id=f"{group}-{index}",
        prompt_id=group,
        group_id=group,
        sample_index=index,
        group_size=size,
        prompt_tokens=np.array([1, 2], dtype=np.int32),
        completion_tokens=np.array([3] * len(tokens), dtype=np.int32),
        behavior_logprobs=np.array([-0.5] * len(tokens), dtype=np.float32),
        reward=1.0,
        policy_version=tokens[-1],
        token_versions=np.array(tokens),
        contract_fingerprint=fp,
        worker_id="w0",
        created_at=0.0,
    )
    return TrajectoryRecord(stream_id=f"0-{group}-{index}", deliveries=1, trajectory=t)


def ids(groups) -> list[list[str]]:
    return [[r.trajectory.sample_id for r in g] for g in groups]


def run(backlog, records, version=5, max_staleness=2, groups=2):
    return admit(backlog, records, version=version, max_staleness=max_staleness, fingerprint=FP, groups_per_step=groups)


def test_complete_groups_are_trained_in_completion_order_with_samples_sorted():
    records = [rec("a", 1), rec("b", 0), rec("b", 1), rec("a", 0)]  # b completes first
    out = run(Backlog(), records)
    assert ids(out.train) == [["b-0", "b-1"], ["a-0", "a-1"]]
    assert out.drops == [] and out.backlog == Backlog()


def test_not_enough_complete_groups_trains_nothing_and_holds_everything():
    out = run(Backlog(), [rec("a", 0), rec("a", 1), rec("b", 0)])
    assert out.train == [] and out.drops == []
    assert ids(out.backlog.complete) == [["a-0", "a-1"]] and ids(out.backlog.incomplete.values()) == [["b-0"]]
    assert out.backlog.num_records == 3
    # The next read completes b: now both train, a (completed earlier) first.
    again = run(out.backlog, [rec("b", 1)])
    assert ids(again.train) == [["a-0", "a-1"], ["b-0", "b-1"]] and again.backlog.num_records == 0


def test_surplus_complete_groups_stay_for_the_next_step():
    records = [rec(g, i) for g in "abc" for i in range(2)] + [rec("d", 0)]
    out = run(Backlog(), records)
    assert ids(out.train) == [["a-0", "a-1"], ["b-0", "b-1"]]
    assert ids(out.backlog.complete) == [["c-0", "c-1"]] and list(out.backlog.incomplete) == ["d"]
    # Next step: the surplus group trains first once another completes, without reading c again.
    nxt = run(out.backlog, [rec("d", 1)])
    assert ids(nxt.train) == [["c-0", "c-1"], ["d-0", "d-1"]]


def test_stale_and_foreign_samples_are_dropped_with_reasons():
    # version 5, max_staleness 2: versions 3..5 admissible, 2 is stale (5 - 2 = 3 > 2).
    ok = [rec("a", 0, version=3), rec("a", 1, version=3)]
    stale = rec("b", 0, version=2)
    foreign = rec("c", 0, fp="0" * 64)
    out = run(Backlog(), [stale, *ok, foreign], groups=1)
    assert ids(out.train) == [["a-0", "a-1"]]
    assert [(d.record.trajectory.sample_id, d.reason) for d in out.drops] == [("b-0", STALE), ("c-0", FINGERPRINT)]
    # A fingerprint mismatch wins over staleness (it is dead-lettered, not just dropped).
    both = run(Backlog(), [rec("d", 0, version=0, fp="0" * 64)])
    assert [d.reason for d in both.drops] == [FINGERPRINT]


def test_held_groups_that_went_stale_are_dropped_whole_when_the_version_moves():
    out = run(Backlog(), [rec("a", 0, version=3), rec("b", 0, version=3), rec("b", 1, version=3)], groups=2)
    assert out.train == [] and out.backlog.num_records == 3
    # The trainer published twice meanwhile: version 6 makes version 3 stale (6 - 3 = 3 > 2).
    later = run(out.backlog, [], version=6)
    assert later.train == [] and later.backlog == Backlog()
    assert sorted((d.record.trajectory.sample_id, d.reason) for d in later.drops) == [
        ("a-0", STALE),
        ("b-0", STALE),
        ("b-1", STALE),
    ]
    # At version 5 the same backlog is still fine.
    assert run(out.backlog, [], version=5).drops == []


def test_synchronous_loop_admits_only_the_current_version():
    out = run(Backlog(), [rec("a", 0, version=4), rec("a", 1, version=5)], max_staleness=0, groups=1)
    assert [d.reason for d in out.drops] == [STALE] and out.train == []
    assert list(out.backlog.incomplete) == ["a"]


def test_inputs_are_not_modified_and_bad_bounds_are_refused():
    first = run(Backlog(), [rec("a", 0)])
    before = first.backlog
    run(before, [rec("a", 1)], groups=1)
    assert ids(before.incomplete.values()) == [["a-0"]] and before.complete == ()
    with pytest.raises(ValueError, match="groups_per_step=0"):
        run(Backlog(), [], groups=0)
    with pytest.raises(ValueError, match="max_staleness=-1"):
        run(Backlog(), [], max_staleness=-1)


# ------------------------------------------------------------------ per-token versions (in-flight updates)


def test_the_oldest_token_decides_a_samples_staleness():
    # Trainer at 5, max_staleness 2: a sample whose first token is v2 is 3 old, though its newest is v5.
    out = run(Backlog(), [rec("a", 0, tokens=[2, 4, 5]), rec("b", 0, tokens=[3, 3, 5]), rec("b", 1, tokens=[3])])
    assert [(d.record.trajectory.sample_id, d.reason) for d in out.drops] == [("a-0", STALE)]
    assert ids(out.backlog.complete) == [["b-0", "b-1"]]
    # One step later (version 6) the v3 tokens are 3 old: the whole held group goes.
    later = run(out.backlog, [], version=6)
    assert sorted(d.record.trajectory.sample_id for d in later.drops) == ["b-0", "b-1"] and later.train == []


def test_a_held_group_goes_when_any_of_its_samples_is_too_old():
    # Sample 0 began under v4, sample 1 under v3 (both end at v5): at version 6 the group is 3 old.
    held = run(Backlog(), [rec("a", 0, tokens=[4, 5]), rec("a", 1, tokens=[3, 5])], groups=2)
    assert held.drops == [] and ids(held.backlog.complete) == [["a-0", "a-1"]]
    assert [d.reason for d in run(held.backlog, [], version=6).drops] == [STALE, STALE]
    assert run(held.backlog, [], version=5, groups=1).train  # at 5 it is 2 old: trained

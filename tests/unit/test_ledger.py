"""trainer.ledger: which prompt groups are fed and not yet settled, driven by hand."""

from __future__ import annotations

import dataclasses

import numpy as np

from broker.codec import PromptGroup
from trainer.ledger import PromptLedger
from trainer.state import State


def make_prompt(i: int) -> PromptGroup:
    return PromptGroup(prompt_id=f"p{i}", group_id=f"p{i}", prompt_tokens=np.array([i, i + 1], np.int32), n_samples=4)


def test_feeding_numbers_prompts_from_prompt_seq_and_holds_them_outstanding():
    state = State(prompt_seq=3)
    ledger = PromptLedger(state, make_prompt)
    assert [g.group_id for g in ledger.feed(2)] == ["p3", "p4"]
    assert state.prompt_seq == 5 and state.outstanding == {"p3": 3, "p4": 4}
    assert ledger.feed(0) == [] and state.prompt_seq == 5
    assert [g.group_id for g in ledger.outstanding_groups()] == ["p3", "p4"]


def test_settling_ends_outstanding_lists_drops_for_the_audit_and_counts_once():
    state = State()
    ledger = PromptLedger(state, make_prompt)
    ledger.feed(3)
    ledger.settle("p1", dropped=False)
    ledger.settle("p0", dropped=True)
    ledger.settle("p0", dropped=True)  # settled already: not listed twice
    ledger.settle("p9", dropped=True)  # never fed: nothing to list
    assert state.outstanding == {"p2": 2}
    assert state.dropped_unaudited == ["p0"]
    assert ledger.settled_recently("p1") and ledger.settled_recently("p9") and not ledger.settled_recently("p2")


def test_fed_prompt_is_the_fed_tokens_while_outstanding_and_fed_as_refuses_a_borrowed_id():
    ledger = PromptLedger(State(), make_prompt)
    ledger.feed(2)
    assert ledger.fed_prompt("p1").tolist() == [1, 2]
    assert ledger.fed_prompt("p7") is None
    assert ledger.fed_as(make_prompt(1))
    assert not ledger.fed_as(dataclasses.replace(make_prompt(1), prompt_tokens=np.array([9, 9], np.int32)))
    assert not ledger.fed_as(dataclasses.replace(make_prompt(1), n_samples=8))
    ledger.settle("p1", dropped=False)
    assert ledger.fed_prompt("p1") is None and not ledger.fed_as(make_prompt(1))


def test_adopt_takes_the_prompts_fed_after_the_checkpoint():
    state = State(prompt_seq=2, outstanding={"p1": 1})
    ledger = PromptLedger(state, make_prompt)
    ledger.adopt(4)
    assert state.prompt_seq == 4 and state.outstanding == {"p1": 1, "p2": 2, "p3": 3}
    ledger.adopt(3)  # behind: nothing changes
    assert state.prompt_seq == 4 and len(state.outstanding) == 3


def test_overflow_drops_the_oldest_beyond_the_cap_and_the_settled_memory_is_bounded():
    state = State()
    ledger = PromptLedger(state, make_prompt, remember=2)
    ledger.feed(5)
    ledger.overflow(5)
    assert len(state.outstanding) == 5
    ledger.overflow(2)
    assert sorted(state.outstanding) == ["p3", "p4"] and state.dropped_unaudited == ["p0", "p1", "p2"]
    assert [ledger.settled_recently(f"p{i}") for i in range(3)] == [False, True, True]  # only the newest 2


def test_state_restore_keeps_defaults_for_missing_fields_and_refuses_unknown_ones():
    state = State(step=9, refed=4)
    state.restore({"step": 3, "version": 2})
    assert (state.step, state.version, state.refed) == (3, 2, 0)
    try:
        state.restore({"step": 1, "no_such_field": 1})
    except ValueError as e:
        assert "no_such_field" in str(e)
    else:
        raise AssertionError("an unknown field was taken")

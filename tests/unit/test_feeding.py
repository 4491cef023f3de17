"""trainer.feeding: when Redis lost what was fed, and how many groups are queued, by hand."""

from __future__ import annotations

from trainer.feeding import min_start_version, queued_groups, redis_lost

N = "a1b2"


def test_redis_lost_its_data_when_the_nonce_is_gone_even_if_a_retried_set_restored_prompt_seq():
    assert redis_lost(b"a1b2", b"12", nonce=N, prompt_seq=12) is None
    # A wipe, then the trainer's prompt_seq SET retried through the outage: prompt_seq is back, the nonce not.
    assert redis_lost(None, b"12", nonce=N, prompt_seq=12) == "this trainer's nonce is gone"
    assert redis_lost(b"other", b"12", nonce=N, prompt_seq=12) == "this trainer's nonce was replaced"
    # A failover that lost only the last writes: the nonce (old) survived, the last feed did not.
    assert redis_lost(b"a1b2", b"10", nonce=N, prompt_seq=12) == "its prompt_seq is 10, ours 12"
    assert redis_lost(b"a1b2", None, nonce=N, prompt_seq=12) == "its prompt_seq is None, ours 12"
    assert redis_lost(b"a1b2", None, nonce=N, prompt_seq=0) is None  # nothing fed yet, no marker written


def test_queued_groups_counts_redis_where_it_has_the_groups_and_what_was_fed_where_it_lost_them():
    # 3 prompts not acked + (10 trajectory entries - 2 consumed) // 4 = 3 + 2
    assert queued_groups(3, 10, consumed=2, group_size=4, outstanding=40) == 5
    assert queued_groups(0, 3, consumed=5, group_size=4, outstanding=9) == 0  # never negative
    # An empty Redis (no group on either stream) must not read as room for the whole bound.
    assert queued_groups(None, 10, consumed=0, group_size=4, outstanding=7) == 7
    assert queued_groups(4, None, consumed=0, group_size=4, outstanding=7) == 7
    assert queued_groups(None, None, consumed=0, group_size=4, outstanding=0) == 0


def test_a_group_may_start_one_version_below_the_trainers_and_none_below_when_synchronous():
    # Fed at version 10 and trained by version 10 + max(0, S - 1): started no earlier than the min
    # version, its oldest token is at most S old then.
    for s, want in [(0, 10), (1, 9), (2, 9), (5, 9)]:
        got = min_start_version(10, max_staleness=s)
        assert got == want and 10 + max(0, s - 1) - got <= s
    assert min_start_version(0, max_staleness=2) == 0  # never below 0

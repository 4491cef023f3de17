"""The fan-out tree of broker.fanout, by hand: who fetches from whom, and the trainer's egress."""

from __future__ import annotations

import pytest

from broker.fanout import TRAINER, sources, stranger_pick, trainer_children

POOL = [f"w{i}" for i in range(8)]


def test_a_tree_of_degree_two_by_hand():
    #            trainer
    #        w0          w1
    #     w2    w3    w4    w5
    #   w6  w7
    assert sources(POOL, 2, "w0") == [TRAINER]
    assert sources(POOL, 2, "w1") == [TRAINER]
    assert sources(POOL, 2, "w2") == ["w0", TRAINER]
    assert sources(POOL, 2, "w5") == ["w1", TRAINER]
    assert sources(POOL, 2, "w6") == ["w2", "w0", TRAINER]
    assert sources(POOL, 2, "w7") == ["w2", "w0", TRAINER]
    assert trainer_children(POOL, 2) == ["w0", "w1"]


def test_the_trainer_sends_degree_copies_whatever_the_pool():
    for n in (1, 2, 5, 32, 256):
        members = [f"w{i}" for i in range(n)]
        first_hops = [sources(members, 4, m)[0] for m in members]
        assert first_hops.count(TRAINER) == min(4, n) == len(trainer_children(members, 4))
        for m in members:  # every chain ends at the trainer, through ancestors only
            chain = sources(members, 4, m)
            assert chain[-1] == TRAINER and len(chain) == len(set(chain))
            assert all(members.index(a) < members.index(m) for a in chain[:-1])


def test_degree_one_is_a_chain():
    assert sources(["a", "b", "c"], 1, "c") == ["b", "a", TRAINER]
    with pytest.raises(ValueError, match="fan-out degree 0"):
        sources(["a"], 0, "a")


def test_a_member_joined_since_the_publish_is_seeded_from_a_peer():
    # sha256("joined-since") starts 75da772ba6f660ac: 0x75da772ba6f660ac % 8 == 4, % 2 == 0;
    # sha256("w9") starts f06dc74f4de7d3a1: % 8 == 1.
    assert stranger_pick(POOL, "joined-since") == "w4"
    assert sources(POOL, 2, "joined-since") == ["w4", "w1", TRAINER]  # w4, then w4's own sources
    assert sources(POOL, 2, "w9") == ["w1", TRAINER]
    assert sources(["a", "b"], 2, "joined-since") == ["a", TRAINER]
    assert sources([], 2, "joined-since") == [TRAINER]  # nobody named: the trainer
    # Stable, and strangers spread over the tree rather than all landing on one member.
    picks = {stranger_pick(POOL, f"new-{i}") for i in range(64)}
    assert stranger_pick(POOL, "new-1") == stranger_pick(list(POOL), "new-1") and len(picks) >= 6
    # The trainer's egress stays the first hops of the named members: a stranger adds none.
    assert all(sources(POOL, 2, f"new-{i}")[0] != TRAINER for i in range(64))

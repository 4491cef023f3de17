"""The fan-out tree of broker.fanout, by hand: who fetches from whom, and the trainer's egress."""

from __future__ import annotations

import pytest

from broker.fanout import TRAINER, sources, trainer_children

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


def test_degree_one_is_a_chain_and_strangers_fetch_from_the_trainer():
    assert sources(["a", "b", "c"], 1, "c") == ["b", "a", TRAINER]
    assert sources(["a", "b"], 2, "joined-since") == [TRAINER]
    with pytest.raises(ValueError, match="fan-out degree 0"):
        sources(["a"], 0, "a")

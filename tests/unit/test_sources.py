"""rollout.sources: the order a worker asks its sources for a version, by hand (no I/O)."""

from __future__ import annotations

from broker.registry import PolicyPointer
from rollout.sources import fetch_sources
from rollout.swap import VersionSwap

D = "d" * 64
TREE = tuple((f"w{i}", f"10.0.0.{i}:7000") for i in range(6))  # degree 2: w2, w3 <- w0; w4, w5 <- w1


def ptr(version: int = 5, *, fanout: int = 2, relays=TREE, digest: str = D) -> PolicyPointer:
    return PolicyPointer(
        version=version, address="trainer:50051", contract_fingerprint="fp", content_digest=digest,
        fanout=fanout, relays=relays,
    )  # fmt: skip


def test_ancestors_nearest_first_then_the_trainer():
    assert fetch_sources(ptr(), "w0") == ["trainer:50051"]
    assert fetch_sources(ptr(), "w4") == ["10.0.0.1:7000", "trainer:50051"]
    assert fetch_sources(ptr(relays=TREE, fanout=1), "w3") == [
        "10.0.0.2:7000", "10.0.0.1:7000", "10.0.0.0:7000", "trainer:50051",
    ]  # fmt: skip
    assert fetch_sources(ptr(fanout=0, relays=()), "w4") == ["trainer:50051"]  # no tree: the trainer


def test_a_worker_joined_since_starts_at_a_peer():
    # sha256("w9") % 6 == 5 (broker.fanout.stranger_pick): w5, then w5's parent w1, then the trainer.
    assert fetch_sources(ptr(), "w9") == ["10.0.0.5:7000", "10.0.0.1:7000", "trainer:50051"]


def test_the_configured_address_replaces_the_trainers_and_is_never_a_relay_twice():
    assert fetch_sources(ptr(), "w4", policy_address="proxy:9") == ["10.0.0.1:7000", "proxy:9"]
    # A relay address that is the trainer's (or named twice) is asked once, last.
    odd = (("w0", "trainer:50051"), ("w1", "10.0.0.1:7000"), ("w2", "10.0.0.1:7000"), ("w3", "x:1"))
    assert fetch_sources(ptr(fanout=1, relays=odd), "w3") == ["10.0.0.1:7000", "trainer:50051"]


def test_distrusted_relays_and_its_own_relay_are_left_out():
    chain = ptr(fanout=1)
    assert fetch_sources(chain, "w2", distrusted={(5, "10.0.0.1:7000", D)}) == ["10.0.0.0:7000", "trainer:50051"]
    # Distrust is per (version, source, digest): the same relay for another version or content is asked.
    assert fetch_sources(chain, "w2", distrusted={(4, "10.0.0.1:7000", D)})[0] == "10.0.0.1:7000"
    assert fetch_sources(ptr(fanout=1, digest="e" * 64), "w2", distrusted={(5, "10.0.0.1:7000", D)})[0] == (
        "10.0.0.1:7000"
    )
    # Its own advertised address, wherever the tree names it (a stale heartbeat of a restarted pod).
    assert fetch_sources(chain, "w2", own_address="10.0.0.0:7000") == ["10.0.0.1:7000", "trainer:50051"]
    # Even every relay distrusted: the trainer is left.
    everything = {(5, a, D) for _, a in TREE}
    assert fetch_sources(chain, "w5", distrusted=everything) == ["trainer:50051"]


def test_the_swap_distrusts_a_relay_for_one_version_and_counts_it():
    s = VersionSwap(fingerprint="fp")
    s.distrust(ptr(fanout=1), "10.0.0.1:7000")
    assert s.distrusted == {(5, "10.0.0.1:7000", D)} and s.sources_distrusted == 1
    assert fetch_sources(ptr(fanout=1), "w2", distrusted=s.distrusted) == ["10.0.0.0:7000", "trainer:50051"]
    # The trainer is still offered: the relay's distrust is not the pointer's source's.
    assert s.offer(ptr(fanout=1), now=0.0, drained=True).action == "fetch"

"""broker.policy_server.admit: who may open a stream, by its rules (hand-checked cases)."""

from __future__ import annotations

import grpc

from broker.policy_server import PolicyServerConfig, admit, peer_address

EXHAUSTED, UNAUTHENTICATED = grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED
SHARED = PolicyServerConfig(
    max_concurrent_rpcs=10, max_unauthenticated_streams=4, max_streams_per_peer=2, run_token="ab" * 32
)


def _admit(config=SHARED, *, auth=False, streams=0, peer=0, unauth=0):
    got = admit(authenticated=auth, streams=streams, peer_streams=peer, unauthenticated_streams=unauth, config=config)
    return None if got is None else got[0]


def test_the_server_cap_holds_for_everyone():
    assert _admit(auth=True, streams=9) is None
    assert _admit(auth=True, streams=10) == EXHAUSTED  # rule 1
    assert _admit(streams=10) == EXHAUSTED


def test_authenticated_workers_keep_what_unauthenticated_peers_cannot_take():
    assert _admit(streams=4, unauth=3, peer=1) is None
    assert _admit(streams=4, unauth=4, peer=0) == EXHAUSTED  # rule 4: the share is full
    assert _admit(auth=True, streams=4, unauth=4, peer=9) is None  # rule 2: 6 of 10 stay for workers


def test_without_a_run_token_nobody_is_told_apart_and_only_addresses_are_limited():
    anyone = PolicyServerConfig(max_concurrent_rpcs=10, max_unauthenticated_streams=4, max_streams_per_peer=2)
    assert _admit(anyone, streams=8, unauth=8, peer=1) is None  # rule 4 needs workers to keep capacity for
    assert _admit(anyone, streams=8, unauth=8, peer=2) == EXHAUSTED  # rule 5
    assert _admit(anyone, streams=10, unauth=10, peer=0) == EXHAUSTED  # rule 1


def test_one_address_holds_at_most_its_streams():
    assert _admit(unauth=1, peer=1) is None
    assert _admit(unauth=2, peer=2) == EXHAUSTED  # rule 5


def test_a_server_with_a_run_token_serves_workers_only_unless_told():
    closed = PolicyServerConfig(run_token="ab" * 32, serve_unauthenticated=False)
    assert _admit(closed) == UNAUTHENTICATED  # rule 3, even with nothing held
    assert _admit(closed, auth=True) is None
    open_ = PolicyServerConfig(run_token="ab" * 32, serve_unauthenticated=True)
    assert _admit(open_) is None


def test_peer_address_drops_the_port():
    assert peer_address("ipv4:127.0.0.1:5555") == "ipv4:127.0.0.1"
    assert peer_address("ipv6:[::1]:5555") == "ipv6:[::1]"
    assert peer_address("unix:/tmp/s") == "unix:/tmp/s"

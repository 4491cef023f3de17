"""A worker's relay (broker.relay) serving a version it fetched and verified, over real gRPC on
loopback: its peer gets the trainer's bytes and manifest bit for bit, and a relay whose bytes went
wrong is caught by the peer's checks."""

from __future__ import annotations

import contextlib

import pytest
from mixed_formats import mixed_tensors
from test_publish_frames import CFG, CONTRACT, assert_bitwise_equal, framed

from broker import frames
from broker.policy_client import ChecksumMismatch, PolicyClient, PolicyClientConfig, ReceiveBuffers
from broker.policy_server import PolicyServer, PolicyServerConfig
from broker.relay import Relay, reframe
from policy.manifest import manifest_digest

pytestmark = pytest.mark.integration


def client(address: str) -> PolicyClient:
    config = PolicyClientConfig(
        address=address, expected_fingerprint=CONTRACT.fingerprint(), call_timeout_s=10.0, fetch_timeout_s=30.0,
        retry_backoff_s=0.0, max_attempts=2,
    )  # fmt: skip
    return PolicyClient(config)


@pytest.fixture
def trainer():
    pool = frames.BufferPool()
    server = PolicyServer(PolicyServerConfig(keep_versions=2))
    server.start()
    yield server, pool
    server.stop()
    pool.close()


def fetch_and_relay(trainer_server, relay: Relay, version: int):
    buffers = ReceiveBuffers()
    with contextlib.closing(client(trainer_server.address)) as c:
        manifest = c.get_manifest(version)
        raw, _, _ = c.fetch_bytes(manifest, buffers=buffers)
    assert relay.offer(manifest, raw) is True
    return manifest


def test_a_peer_gets_the_trainers_version_from_a_relay_bit_for_bit(trainer):
    server, pool = trainer
    relay = Relay(PolicyServerConfig(keep_versions=2))
    relay.start()
    try:
        for v in (1, 2, 3):
            want = mixed_tensors(CFG, v)
            server.publish(framed(v, want, pool))
            manifest = fetch_and_relay(server, relay, v)
            with contextlib.closing(client(relay.address)) as peer:
                got = peer.fetch(v)
            assert manifest_digest(got.manifest) == manifest_digest(manifest)
            assert_bitwise_equal(got.tensors, want)
        assert relay.server.versions() == [2, 3] and relay.pool.free_buffers() == 1  # v1's buffer back
        assert relay.offer(manifest, {}) is False  # not newer than what it serves
    finally:
        relay.stop()


def test_a_relay_serving_a_flipped_byte_is_refused_by_its_peer(trainer, monkeypatch):
    server, pool = trainer
    relay = Relay(PolicyServerConfig(keep_versions=2))
    relay.start()
    try:
        server.publish(framed(1, mixed_tensors(CFG, 1), pool))
        buffers = ReceiveBuffers()
        with contextlib.closing(client(server.address)) as c:
            manifest = c.get_manifest(1)
            raw, _, _ = c.fetch_bytes(manifest, buffers=buffers)
        name = max(raw, key=lambda n: len(raw[n]))
        bad = dict(raw)
        bad[name] = raw[name].copy()
        bad[name][len(bad[name]) // 2] ^= 0x40
        relay.offer(manifest, bad)
        with contextlib.closing(client(relay.address)) as peer, pytest.raises(ChecksumMismatch):
            peer.fetch(1)
    finally:
        relay.stop()


def test_reframe_refuses_missing_or_partial_tensors(trainer):
    server, pool = trainer
    server.publish(framed(1, mixed_tensors(CFG, 1), pool))
    with contextlib.closing(client(server.address)) as c:
        manifest = c.get_manifest(1)
        raw, _, _ = c.fetch_bytes(manifest)
    name = next(iter(raw))
    for partial in ({**raw, name: raw[name][:-1]}, {n: b for n, b in raw.items() if n != name}):
        with pytest.raises(ValueError, match=f"no whole bytes for \\['{name}'\\]"):
            reframe(manifest, partial, pool)

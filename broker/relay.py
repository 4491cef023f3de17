"""Rollout workers serving the versions they hold to other workers (relays; the tree: broker.fanout).

A worker that fetched and verified a whole version (tp_size 1) serves it to peers with the
trainer's own server code (broker.policy_server.PolicyServer: the same limits, run token and TLS).
`reframe` lays the verified bytes out as the TensorChunk messages the trainer served, with the
manifest's own checksums: nothing is hashed again (every chunk was checked on receipt, and the
peer that fetches checks each again, so a relay that corrupts a byte is caught by its reader).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

import numpy as np

from broker.frames import BufferPool, FramedPolicy, manifest_layout
from broker.policy_server import PolicyServer, PolicyServerConfig
from tandem.v1 import manifest_pb2


def reframe(manifest: manifest_pb2.Manifest, tensors: Mapping[str, np.ndarray], pool: BufferPool) -> FramedPolicy:
    """A verified version's bytes (name -> uint8 array, whole tensors) framed as the trainer served
    them, into a buffer from `pool` (given back when the server releases the version)."""
    layout = manifest_layout(manifest)
    missing = [t.name for t in manifest.tensors if t.name not in tensors or len(tensors[t.name]) != t.nbytes]
    if missing:
        raise ValueError(f"version {manifest.version}: no whole bytes for {missing[:3]} (a relay serves whole tensors)")
    host = pool.acquire(layout.size)
    data = host.array[: layout.size]
    mv = memoryview(data)
    for pos, head in layout.heads:
        mv[pos : pos + len(head)] = head
    for frames, entry in zip(layout.tensors, manifest.tensors):
        src = tensors[entry.name]
        for j, ((a, b), at) in enumerate(zip(frames.data, frames.xxh3_at)):
            data[a:b] = src[j * frames.chunk_bytes : j * frames.chunk_bytes + b - a]
            struct.pack_into("<Q", mv, at, entry.chunk_xxh3[j])
        mv[frames.sha256_at : frames.sha256_at + 32] = entry.sha256
    return FramedPolicy(manifest, layout, data, release=lambda: pool.release(host), host=host)


class Relay:
    """A worker's policy server for its peers: `offer` each version it verified (whole); it serves
    the newest `config.keep_versions`."""

    def __init__(self, config: PolicyServerConfig):
        self.server = PolicyServer(config)
        self.pool = BufferPool()

    def start(self) -> int:
        return self.server.start()

    @property
    def address(self) -> str:
        return self.server.address

    def offer(self, manifest: manifest_pb2.Manifest, tensors: Mapping[str, np.ndarray]) -> bool:
        """Serve a verified version (True if new). One older than the newest served is not offered."""
        if manifest.version <= max(self.server.versions(), default=0):
            return False
        return self.server.publish(reframe(manifest, tensors, self.pool))

    def stop(self) -> None:
        self.server.stop()
        self.pool.close()

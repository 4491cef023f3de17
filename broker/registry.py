"""Where the current policy is (`policy:latest` + announce channel) and who is alive (heartbeats).

`policy:latest` is a hash {version, address, contract_fingerprint, published_at, content_digest,
fanout, relays} (content_digest: the manifest's own digest, policy.manifest.manifest_digest, hex:
what the worker trusts, whoever serves the bytes; fanout and relays: the tree of worker relays the
version travels over, broker.fanout; all signed together, and a signature is required by a worker
with the run secret). A Lua
script updates it only forward (a higher version; or the same version with the same
fingerprint, e.g. a restarted policy server on a new address) and publishes on the
announce channel in the same atomic step. Pub/sub is fire-and-forget, so watchers treat a
message only as a wake-up and read `policy:latest`, which they also poll every `poll_s`:
a missed message costs at most one poll interval, never a version.

Heartbeats: `heartbeat:{worker}` holds a small JSON object and expires after its TTL; the
`workers` set indexes the ids so listing never SCANs the keyspace (ids whose key expired
are pruned while listing).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from broker import fanout
from broker.keys import Keys, check_name
from broker.outage import run_script
from broker.signing import POLICY_POINTER, Signer
from policy.fields import is_int

_MAX_EXACT_VERSION = 2**53  # Lua compares versions as doubles
_MAX_INFO_BYTES = 4096
MAX_FANOUT = 64
MAX_RELAYS = 4096  # members a pointer names (a pool larger than this fetches past them from the trainer)

_PUBLISH = """
local cur = redis.call('HGET', KEYS[1], 'version')
if cur then
  local v, c = tonumber(ARGV[1]), tonumber(cur)
  if v < c then return 0 end
  if v == c and redis.call('HGET', KEYS[1], 'contract_fingerprint') ~= ARGV[3] then
    return redis.error_reply('version ' .. ARGV[1] .. ' was already published with another contract fingerprint')
  end
end
redis.call('HSET', KEYS[1], 'version', ARGV[1], 'address', ARGV[2], 'contract_fingerprint', ARGV[3],
           'published_at', ARGV[4], 'content_digest', ARGV[5], 'fanout', ARGV[6], 'relays', ARGV[7],
           'sig', ARGV[10])
redis.call('PUBLISH', ARGV[8], ARGV[9])
return 1
"""


@dataclass(frozen=True, kw_only=True)
class PolicyPointer:
    version: int
    address: str  # where the policy server for this version listens, e.g. "127.0.0.1:50051"
    contract_fingerprint: str
    published_at: float = 0.0
    content_digest: str = ""  # hex manifest_digest of the version's manifest ("": none, refused when signed)
    # The fan-out tree (broker.fanout): its degree (0: every worker fetches from `address`) and the
    # members in tree order, each (worker id, its relay's "host:port").
    fanout: int = 0
    relays: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        errors = []
        if not is_int(self.version, 0, _MAX_EXACT_VERSION - 1):
            errors.append(f"version={self.version!r} (want an int in [0, 2**53))")
        for name in ("address", "contract_fingerprint"):
            v = getattr(self, name)
            if not isinstance(v, str) or not 0 < len(v) <= 256 or any(ch.isspace() for ch in v):
                errors.append(f"{name}={v!r} (want 1-256 characters, no whitespace)")
        if not isinstance(self.published_at, (int, float)) or not math.isfinite(self.published_at):
            errors.append(f"published_at={self.published_at!r} (want a finite number)")
        d = self.content_digest
        if not isinstance(d, str) or d and (len(d) != 64 or d.strip("0123456789abcdef")):
            errors.append(f"content_digest={str(d)[:80]!r} (want '' or 64 lowercase hex characters)")
        errors += _relay_errors(self.fanout, self.relays)
        if errors:
            raise ValueError("PolicyPointer: " + "; ".join(errors))

    def sources(self, member: str) -> list[str]:
        """The addresses `member` fetches this version from, in order (its ancestors' relays, then
        the trainer's `address`; a member not named starts at a peer: broker.fanout.sources)."""
        if not self.fanout:
            return [self.address]
        relay_of = dict(self.relays)
        chain = fanout.sources([m for m, _ in self.relays], self.fanout, member)
        return [relay_of[m] if m != fanout.TRAINER else self.address for m in chain]

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": self.version,
                "address": self.address,
                "contract_fingerprint": self.contract_fingerprint,
                "published_at": self.published_at,
                "content_digest": self.content_digest,
                "fanout": self.fanout,
                "relays": [list(r) for r in self.relays],
            }
        )


def _relay_errors(degree: object, relays: object) -> list[str]:
    if not is_int(degree, 0, MAX_FANOUT):
        return [f"fanout={degree!r} (want an int in [0, {MAX_FANOUT}])"]
    if not isinstance(relays, tuple) or len(relays) > MAX_RELAYS:
        return [f"relays: want a tuple of at most {MAX_RELAYS} (worker id, address) pairs"]
    if relays and not degree:
        return ["relays without a fanout degree"]
    bad = [
        r for r in relays
        if not (isinstance(r, tuple) and len(r) == 2 and all(isinstance(x, str) and 0 < len(x) <= 256 for x in r))
        or any(ch.isspace() for ch in "".join(r))
    ]  # fmt: skip
    ids = [r[0] for r in relays]
    if bad:
        return [f"relays: {str(bad[0])[:80]} is not a (worker id, address) pair of 1-256 characters each"]
    if len(set(ids)) != len(ids):
        return ["relays: a worker named twice"]
    return []


_SIGNED = (b"version", b"address", b"contract_fingerprint", b"published_at", b"content_digest", b"fanout", b"relays")


def _signed_bytes(*fields: str) -> bytes:
    return "\n".join(fields).encode()


def parse_pointer(h: dict[bytes, bytes]) -> PolicyPointer | None:
    """The PolicyPointer a `policy:latest` hash holds; None if it is malformed (never raises)."""
    try:
        return PolicyPointer(
            version=int(h[b"version"]),
            address=h[b"address"].decode(),
            contract_fingerprint=h[b"contract_fingerprint"].decode(),
            published_at=float(h[b"published_at"]),
            content_digest=h.get(b"content_digest", b"").decode(),
            fanout=int(h.get(b"fanout", b"0")),
            relays=tuple(tuple(r) for r in json.loads(h.get(b"relays", b"[]"))),
        )
    except (KeyError, ValueError, UnicodeDecodeError, AttributeError, TypeError):
        return None


def pointer_signed(h: dict[bytes, bytes], signer: Signer) -> bool:
    """Whether a `policy:latest` hash carries a content digest and a valid signature of its fields
    (never raises)."""
    try:
        fields = [h[k].decode() for k in _SIGNED]
        signed, tag = _signed_bytes(*fields), bytes.fromhex(h.get(b"sig", b"").decode())
    except (KeyError, ValueError, UnicodeDecodeError, AttributeError):
        return False
    if not h[b"content_digest"]:  # a pointer that does not name its content authenticates nothing of it
        return False
    return signer.verify(POLICY_POINTER, signed, tag)


class PolicyRegistry:
    """With a `signer` (broker.signing), publish() signs the pointer and latest() refuses (returns None
    for, and counts in `refused`) a pointer without a valid signature or without a content digest."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, signer: Signer | None = None):
        self.redis, self.keys, self.signer = redis, keys, signer
        self.refused = 0  # malformed, unsigned or badly signed pointers seen by latest()

    async def publish(self, pointer: PolicyPointer) -> bool:
        """Point `policy:latest` at `pointer` and announce it. Returns False (and changes
        nothing) if a newer version is already published; raises ValueError if the same
        version was published with another contract fingerprint."""
        if pointer.published_at == 0.0:
            pointer = dataclasses.replace(pointer, published_at=time.time())
        fields = (
            str(pointer.version),
            pointer.address,
            pointer.contract_fingerprint,
            repr(float(pointer.published_at)),
            pointer.content_digest,
            str(pointer.fanout),
            json.dumps([list(r) for r in pointer.relays], separators=(",", ":")),
        )
        sig = "" if self.signer is None else self.signer.sign(POLICY_POINTER, _signed_bytes(*fields)).hex()
        try:
            ok = await run_script(
                self.redis,
                _PUBLISH,
                keys=[self.keys.policy_latest],
                args=[*fields, self.keys.announce, pointer.to_json(), sig],
            )
        except ResponseError as e:
            if "another contract fingerprint" in str(e):
                raise ValueError(f"PolicyRegistry.publish: {e}") from None
            raise
        return bool(ok)

    async def latest(self) -> PolicyPointer | None:
        h = await self.redis.hgetall(self.keys.policy_latest)
        if not h:
            return None
        if self.signer is not None and not pointer_signed(h, self.signer):
            self.refused += 1
            return None
        pointer = parse_pointer(h)
        if pointer is None:  # malformed: refused like an unsigned one, never a crash of the reader
            self.refused += 1
        return pointer

    async def watch(self, *, after_version: int = -1, poll_s: float = 2.0) -> AsyncIterator[PolicyPointer]:
        """Yield each newer `policy:latest` as it appears (versions strictly increase;
        intermediate versions may be skipped if they were superseded before we looked).
        Runs until the caller stops iterating."""
        if not 0 < poll_s <= 60:
            raise ValueError(f"poll_s={poll_s}: want 0 < poll_s <= 60")
        last = after_version
        pubsub = self.redis.pubsub()
        try:
            await pubsub.subscribe(self.keys.announce)  # before the first read: no gap
            while True:
                p = await self.latest()
                if p is not None and p.version > last:
                    last = p.version
                    yield p
                try:
                    await pubsub.get_message(ignore_subscribe_messages=True, timeout=poll_s)
                except (RedisConnectionError, RedisTimeoutError, OSError):
                    await asyncio.sleep(poll_s)  # pub/sub is an optimization: fall back to polling
        finally:
            try:
                await pubsub.aclose()
            except Exception:
                pass

    async def wait_for(self, min_version: int = 0, *, timeout_s: float, poll_s: float = 1.0) -> PolicyPointer:
        """The first pointer with version >= min_version; TimeoutError after timeout_s."""

        async def first() -> PolicyPointer:
            async with contextlib.aclosing(self.watch(after_version=min_version - 1, poll_s=poll_s)) as versions:
                async for p in versions:
                    return p
            raise AssertionError("watch() ended")  # unreachable: watch never ends on its own

        return await asyncio.wait_for(first(), timeout_s)


class Heartbeats:
    def __init__(self, redis: aioredis.Redis, keys: Keys):
        self.redis, self.keys = redis, keys

    async def beat(self, worker_id: str, *, ttl_s: float, role: str, info: dict[str, Any] | None = None) -> None:
        """Say `worker_id` is alive for the next `ttl_s` seconds."""
        if not 0.01 <= ttl_s <= 3600:
            raise ValueError(f"ttl_s={ttl_s}: want 0.01..3600")
        check_name("role", role)
        value = json.dumps({"worker_id": worker_id, "role": role, "at": time.time(), "info": info or {}})
        if len(value) > _MAX_INFO_BYTES:
            raise ValueError(f"heartbeat info for {worker_id!r} is {len(value)} bytes > {_MAX_INFO_BYTES}")
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(self.keys.heartbeat(worker_id), value, px=max(1, int(ttl_s * 1000)))
            pipe.sadd(self.keys.workers, worker_id)
            await pipe.execute()

    async def live(self, role: str | None = None) -> dict[str, dict[str, Any]]:
        """worker_id -> its last heartbeat ({worker_id, role, at, info}) for unexpired workers (a value
        that is no JSON object is left out)."""
        ids = sorted(m.decode() for m in await self.redis.smembers(self.keys.workers))
        if not ids:
            return {}
        values = await self.redis.mget([self.keys.heartbeat(i) for i in ids])
        dead = [i for i, v in zip(ids, values) if v is None]
        if dead:
            await self.redis.srem(self.keys.workers, *dead)
        out = {}
        for i, v in zip(ids, values):
            try:
                beat = None if v is None else json.loads(v)
            except (ValueError, UnicodeDecodeError):  # written by somebody else: not a heartbeat
                continue
            if isinstance(beat, dict) and (role is None or beat.get("role") == role):
                out[i] = beat
        return out

    async def remove(self, worker_id: str) -> None:
        """Graceful shutdown: disappear now instead of after the TTL."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.keys.heartbeat(worker_id))
            pipe.srem(self.keys.workers, worker_id)
            await pipe.execute()

    async def run(
        self,
        worker_id: str,
        *,
        role: str,
        stop: asyncio.Event,
        interval_s: float = 2.0,
        ttl_s: float = 10.0,
        info: Callable[[], dict[str, Any]] = dict,
    ) -> None:
        """Beat every `interval_s` until `stop` is set, then remove the heartbeat."""
        if not 0 < interval_s < ttl_s:
            raise ValueError(f"interval_s={interval_s}, ttl_s={ttl_s}: want 0 < interval_s < ttl_s")
        try:
            while not stop.is_set():
                await self.beat(worker_id, ttl_s=ttl_s, role=role, info=info())
                try:
                    await asyncio.wait_for(stop.wait(), interval_s)
                except TimeoutError:
                    pass
        finally:
            await self.remove(worker_id)

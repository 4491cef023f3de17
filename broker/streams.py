"""Redis Streams with consumer groups: the prompts and trajectories queues.

Delivery is at-least-once; exactly-once *effect* comes from idempotency keys. Rules:
- `GroupConsumer.read()` returns entries the janitor just claimed, then this consumer's own pending
  entries (what a crashed incarnation of the same name read but did not ack), then new ones; every
  `Entry` carries its delivery count. The caller acks only after its side effect succeeded.
- The janitor (from `read()` every `janitor_every_s`) claims entries idle longer than
  `claim_idle_ms` from any consumer, dead-letters entries delivered more than `max_deliveries`
  times with the reason, and trims below the oldest entry some group still needs. Consumers renew
  what they hold longer with `keep_alive()`; a consumer never reclaims its own entries.
- `TrajectoryStream.commit()` sets `SET NX EX` idempotency keys and XACKs in one Lua call; `read()`
  drops (and acks) samples whose key exists, so a trajectory delivered twice is used once.
- Where Redis lost a stream or its group (NOGROUP, UNBLOCKED), every consumer call makes the group
  again from id 0 and carries on (`Counters.regrouped`). Simplified: one data field per entry (`d`,
  msgpack); no deletion of idle consumer names; Redis 7.0 commands only."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from broker.codec import (
    DEFAULT_LIMITS,
    CodecError,
    CodecLimits,
    PromptGroup,
    Trajectory,
    decode_prompt_group,
    decode_trajectory,
    encode_prompt_group,
    encode_trajectory,
)
from broker.keys import PROMPTS_GROUP, TRAJECTORIES_GROUP, Keys, check_name
from broker.outage import OutageRetry, run_script
from broker.signing import PROMPT, TRAJECTORY, Signer
from policy.fields import is_int, is_number

DATA_FIELD = b"d"
SIG_FIELD = b"s"  # HMAC of DATA_FIELD (broker.signing), on prompt and trajectory entries when the run has a secret
_DL_PREFIX = "orig:"
T = TypeVar("T")
# Replies meaning Redis lost the stream or the group: to any group command, and to an XREADGROUP
# blocked while its stream was deleted ("UNBLOCKED the stream key no longer exists").
_LOST = ("NOGROUP", "UNBLOCKED")


def run_async(main: Awaitable[Any]) -> Any:
    """Run a coroutine on uvloop where it is installed, else on the default asyncio loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def connect(
    url: str, *, timeout_s: float = 35.0, outage_s: float = 60.0, log: Callable[[str], None] = print
) -> aioredis.Redis:
    """An asyncio Redis client with bounded socket timeouts that rides out Redis outages.

    `timeout_s` must exceed the longest XREADGROUP BLOCK (StreamConfig caps it at 30 s). Every
    command retries through a restart or failover for up to `outage_s` seconds (broker.outage),
    then raises `RedisOutage`.
    """
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"url={url!r}: want redis://, rediss:// or unix://")
    if not 0 < timeout_s <= 300:
        raise ValueError(f"timeout_s={timeout_s}: want 0 < t <= 300")
    return aioredis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=min(timeout_s, 5.0),
        health_check_interval=30,
        retry=OutageRetry(outage_s=outage_s, log=log),
    )


@dataclass(frozen=True, kw_only=True)
class StreamConfig:
    read_count: int = 64  # entries per read()
    block_ms: int = 1000  # XREADGROUP BLOCK for new entries; 0 = do not block
    claim_idle_ms: int = 60_000  # an entry pending this long is presumed abandoned
    max_deliveries: int = 5  # more deliveries than this -> dead-letter stream
    janitor_every_s: float = 5.0  # read() runs the janitor this often; 0 = never
    janitor_count: int = 256  # pending entries examined per janitor pass
    trim: bool = True  # janitor trims entries every group has acked
    deadletter_maxlen: int = 100_000  # approximate cap of the dead-letter stream (entries)
    # A dead letter keeps an entry's fields up to this many bytes each; a larger field is replaced by a
    # reference (its size and first bytes), so the dead-letter stream holds at most about
    # deadletter_max_bytes (its length is capped at deadletter_max_bytes // (inline + 1 KiB) too).
    deadletter_inline_bytes: int = 16 << 10
    deadletter_max_bytes: int = 64 << 20
    # What one read() may pull: count is cut to max_read_bytes // max_entry_bytes (Redis returns
    # whole entries; the codec refuses anything above its 4 MiB limit only after the read).
    max_entry_bytes: int = DEFAULT_LIMITS.max_message_bytes + (4 << 10)
    max_read_bytes: int = 256 << 20
    idempotency_ttl_s: int = 7 * 24 * 3600  # lifetime of "sample already used" markers

    def __post_init__(self) -> None:
        errors = []

        def want(ok: bool, name: str, rule: str) -> None:
            if not ok:
                errors.append(f"{name}={getattr(self, name)!r} ({rule})")

        want(is_int(self.read_count, 1, 10_000), "read_count", "1..10000")
        want(is_int(self.block_ms, 0, 30_000), "block_ms", "0..30000")
        want(is_int(self.claim_idle_ms, lo=1), "claim_idle_ms", ">= 1")
        want(is_int(self.max_deliveries, 1, 1000), "max_deliveries", "1..1000")
        want(is_number(self.janitor_every_s, lo=0), "janitor_every_s", ">= 0")
        want(is_int(self.janitor_count, 1, 10_000), "janitor_count", "1..10000")
        want(isinstance(self.trim, bool), "trim", "bool")
        want(is_int(self.deadletter_maxlen, lo=1), "deadletter_maxlen", ">= 1")
        want(is_int(self.idempotency_ttl_s, lo=1), "idempotency_ttl_s", ">= 1")
        for name in ("deadletter_inline_bytes", "deadletter_max_bytes", "max_entry_bytes"):
            want(is_int(getattr(self, name), lo=1), name, ">= 1")
        ok = is_int(self.max_read_bytes) and self.max_read_bytes >= self.max_entry_bytes
        want(ok, "max_read_bytes", ">= max_entry_bytes")
        if errors:
            raise ValueError("StreamConfig: " + "; ".join(errors))

    @property
    def max_read_count(self) -> int:
        """Entries one read may return: at most max_read_bytes of them at max_entry_bytes each."""
        return max(1, self.max_read_bytes // self.max_entry_bytes)

    @property
    def deadletter_cap(self) -> int:
        """Length cap of the dead-letter stream: by count, and by bytes at the inline size per entry."""
        return max(1, min(self.deadletter_maxlen, self.deadletter_max_bytes // (self.deadletter_inline_bytes + 1024)))


@dataclass(frozen=True)
class Entry:
    id: str
    fields: dict[bytes, bytes]
    deliveries: int  # how many times Redis has handed this entry to a consumer, this time included


@dataclass(frozen=True)
class JanitorReport:
    recovered: int = 0  # this consumer's own pending entries, queued for the next read()
    claimed: int = 0  # entries taken over from idle consumers (returned by the next read())
    dead_lettered: int = 0  # entries over max_deliveries moved to the dead-letter stream
    trimmed: int = 0  # entries removed from the stream (acked by every group)


@dataclass(frozen=True)
class DeadLetter:
    id: str
    source: str  # stream key the entry came from
    source_id: str
    group: str
    consumer: str
    deliveries: int
    reason: str
    at: float
    fields: dict[bytes, bytes]  # the original entry's fields (those up to deadletter_inline_bytes)
    oversized: dict[bytes, tuple[int, bytes]] = field(default_factory=dict)  # the others: (size, first bytes)


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _next_id(stream_id: str) -> str:
    ms, seq = stream_id.split("-")
    return f"{ms}-{int(seq) + 1}"


def _id_key(stream_id: str) -> tuple[int, int]:
    ms, seq = stream_id.split("-")
    return int(ms), int(seq)


def _signed_fields(payload: bytes, signer: Signer | None, domain: bytes = TRAJECTORY) -> dict[bytes, bytes]:
    if signer is None:
        return {DATA_FIELD: payload}
    return {DATA_FIELD: payload, SIG_FIELD: signer.sign(domain, payload)}


def signature_refusal(fields: dict[bytes, bytes], signer: Signer | None, domain: bytes) -> str | None:
    """Why an entry's `d` is not signed with the run's secret under `domain`; None when it is, or
    when the run has no secret."""
    payload = fields.get(DATA_FIELD)
    if signer is None or (isinstance(payload, bytes) and signer.verify(domain, payload, fields.get(SIG_FIELD))):
        return None
    why = "unsigned" if SIG_FIELD not in fields else "bad signature"
    return f"{why}: not signed with this run's secret"


async def add_entries(
    redis: aioredis.Redis,
    stream: str,
    payloads: Sequence[bytes],
    signer: Signer | None = None,
    domain: bytes = TRAJECTORY,
) -> list[str]:
    """XADD each payload as `{d: payload}` (plus `s`, its HMAC under `domain`, with a signer) in one
    pipelined round trip; returns the ids."""
    if not payloads:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for payload in payloads:
            pipe.xadd(stream, _signed_fields(payload, signer, domain))
        return [_s(i) for i in await pipe.execute()]


async def ensure_group(redis: aioredis.Redis, stream: str, group: str) -> None:
    """Create the group (and the stream) if missing; from id 0 so that entries added
    before the first consumer started are delivered too."""
    try:
        await redis.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


async def stream_stats(redis: aioredis.Redis, stream: str) -> dict[str, Any]:
    """Length and, per group, pending count and lag (undelivered entries): what an
    autoscaler or a producer applying backpressure looks at."""
    try:
        groups = await redis.xinfo_groups(stream)
    except ResponseError as e:
        if "no such key" in str(e).lower():
            return {"length": 0, "groups": {}}
        raise
    return {
        "length": int(await redis.xlen(stream)),
        "groups": {
            _s(g["name"]): {
                "pending": int(g["pending"]),
                "lag": await _lag(redis, stream, g),
                "consumers": int(g["consumers"]),
                "last_delivered": _s(g["last-delivered-id"]),
            }
            for g in groups
        },
    }


LAG_COUNT_CAP = 10_000  # where Redis does not know a group's lag, count at most this many entries


async def _lag(redis: aioredis.Redis, stream: str, group: dict) -> int:
    """Entries never delivered to the group. Redis 7.0 reports lag None when it cannot tell (after
    reloading from AOF it forgets the group's entries-read): then count the entries after its last
    delivered id, up to LAG_COUNT_CAP (a lower bound past that, still enough for backpressure)."""
    if group.get("lag") is not None:
        return int(group["lag"])
    after = "(" + _s(group["last-delivered-id"])
    return len(await redis.xrange(stream, min=after, max="+", count=LAG_COUNT_CAP))


async def read_deadletter(redis: aioredis.Redis, keys: Keys, count: int = 100, start: str = "-") -> list[DeadLetter]:
    """The oldest `count` dead letters from `start` (inclusive)."""
    out = []
    for sid, f in await redis.xrange(keys.deadletter, min=start, max="+", count=count):
        meta = {_s(k): v for k, v in f.items() if not _s(k).startswith(_DL_PREFIX)}
        out.append(
            DeadLetter(
                id=_s(sid),
                source=_s(meta.get("source", b"")),
                source_id=_s(meta.get("source_id", b"")),
                group=_s(meta.get("group", b"")),
                consumer=_s(meta.get("consumer", b"")),
                deliveries=int(meta.get("deliveries", b"0")),
                reason=_s(meta.get("reason", b"")),
                at=float(meta.get("at", b"0")),
                fields={k[len(_DL_PREFIX) :]: v for k, v in f.items() if _s(k).startswith(_DL_PREFIX)},
                oversized={
                    k[len("size:") :].encode(): (int(v), meta.get("prefix:" + k[len("size:") :], b""))
                    for k, v in meta.items()
                    if k.startswith("size:")
                },
            )
        )
    return out


class GroupConsumer:
    """One named consumer of one consumer group on one stream (raw entries).

    The janitor claims with XPENDING IDLE + XCLAIM (XAUTOCLAIM cannot skip the entries this process
    still holds). An entry held past `claim_idle_ms` without `keep_alive()` is taken by another
    consumer's janitor: it is then processed twice, and the idempotency key drops the second result.
    Where a stream or group is gone, XACK, the commit script and dead-lettering find nothing to ack,
    harmlessly."""

    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        stream: str,
        group: str,
        consumer: str,
        deadletter: str,
        config: StreamConfig = StreamConfig(),
    ):
        self.redis = redis
        self.stream = stream
        self.group = group
        self.consumer = check_name("consumer", consumer)
        self.deadletter_stream = deadletter
        self.config = config
        self._backlog_cursor: str | None = "0"  # own PEL first; None once drained
        self._claimed: deque[Entry] = deque()
        self._held: set[str] = set()  # returned or queued, not yet acked / dead-lettered
        self._scan_from = "-"  # janitor's XPENDING position, wraps around
        self._last_janitor = float("-inf")
        self._group_ready = False
        self.counters = Counters()

    async def ensure_group(self) -> None:
        await ensure_group(self.redis, self.stream, self.group)
        self._group_ready = True

    # ------------------------------------------------------------ reading

    async def read(self, count: int | None = None, block_ms: int | None = None) -> list[Entry]:
        """Up to `count` entries: claimed ones, then own pending, then new (blocking up to
        `block_ms` only when nothing else is available). Entries over `max_deliveries` and
        entries deleted from the stream never reach the caller."""
        cfg = self.config
        count = cfg.read_count if count is None else count
        block_ms = cfg.block_ms if block_ms is None else block_ms
        if not 1 <= count <= 10_000:
            raise ValueError(f"count={count}: want 1..10000")
        count = min(count, cfg.max_read_count)
        if not 0 <= block_ms <= 30_000:
            raise ValueError(f"block_ms={block_ms}: want 0..30000")
        got = await self._or_regroup(lambda: self._read(count, block_ms), None)
        if got is None:  # the group was made again: read from it (what was added since the loss)
            got = await self._or_regroup(lambda: self._read(count, block_ms), [])
        return got

    async def _or_regroup(self, op: Callable[[], Awaitable[T]], lost: T) -> T:
        """`await op()`, or `lost` where Redis lost the stream or this group (NOGROUP, or UNBLOCKED to a
        blocked read: a restart without its data, a failover to an empty replica, FLUSHALL, DEL). The
        group is made again (from id 0, so
        entries added since the loss are delivered) and this consumer starts over from its now empty
        pending list; the entries it holds stay its caller's (their acks find nothing, harmlessly).
        Every group command of this class goes through here (XACK of a lost group answers 0 itself)."""
        try:
            return await op()
        except ResponseError as e:
            if not any(tag in str(e) for tag in _LOST):  # in a pipeline's error, the reply is quoted
                raise
        self.counters.regrouped += 1
        self._backlog_cursor, self._scan_from = "0", "-"
        await self.ensure_group()
        return lost

    async def _read(self, count: int, block_ms: int) -> list[Entry]:
        cfg = self.config
        if not self._group_ready:
            await self.ensure_group()
        if cfg.janitor_every_s and time.monotonic() - self._last_janitor >= cfg.janitor_every_s:
            await self.janitor()

        out: list[Entry] = []
        while self._claimed and len(out) < count:
            out.append(self._claimed.popleft())
        # Bounded: each pass either fills `out`, advances the cursor, or ends the backlog.
        for _ in range(1000):
            if len(out) >= count or self._backlog_cursor is None:
                break
            out += await self._read_backlog(count - len(out))
        if not out:
            out = await self._read_new(count, block_ms)
        return out

    async def _read_backlog(self, count: int) -> list[Entry]:
        resp = await self.redis.xreadgroup(self.group, self.consumer, {self.stream: self._backlog_cursor}, count=count)
        raw = resp[0][1] if resp else []
        if not raw:
            self._backlog_cursor = None
            return []
        ids = [_s(i) for i, _ in raw]
        self._backlog_cursor = ids[-1]
        rows = await self.redis.xpending_range(
            self.stream, self.group, min=ids[0], max=ids[-1], count=len(ids), consumername=self.consumer
        )
        deliveries = {_s(r["message_id"]): int(r["times_delivered"]) for r in rows}
        out, gone = [], []
        for sid, fields in zip(ids, (f for _, f in raw)):
            if sid in self._held:
                continue  # re-read of something this process already holds
            if not fields:  # deleted from the stream (trimmed) while pending: nothing to do
                gone.append(sid)
                continue
            entry = Entry(sid, fields, deliveries.get(sid, 1))
            if entry.deliveries > self.config.max_deliveries:
                self.counters.dead_lettered += 1
                await self._dead_letter(entry, self._too_many(entry))
                continue
            self._held.add(sid)
            out.append(entry)
        if gone:
            await self.redis.xack(self.stream, self.group, *gone)
        return out

    async def _read_new(self, count: int, block_ms: int) -> list[Entry]:
        resp = await self.redis.xreadgroup(
            self.group, self.consumer, {self.stream: ">"}, count=count, block=block_ms or None
        )
        out = [Entry(_s(i), f, 1) for i, f in (resp[0][1] if resp else [])]
        self._held.update(e.id for e in out)
        return out

    def _too_many(self, entry: Entry) -> str:
        return f"delivered {entry.deliveries} times (max_deliveries={self.config.max_deliveries})"

    # ------------------------------------------------------------ settling

    async def ack(self, ids: Iterable[str]) -> int:
        """XACK after the side effect succeeded; returns how many were still pending."""
        ids = list(ids)
        if not ids:
            return 0
        n = int(await self.redis.xack(self.stream, self.group, *ids))
        self._held.difference_update(ids)
        return n

    def release(self, ids: Iterable[str]) -> None:
        """Stop tracking entries the caller acked itself (inside its own transaction)."""
        self._held.difference_update(ids)

    async def dead_letter(self, entry: Entry, reason: str) -> None:
        """Move an entry to the dead-letter stream with `reason` (atomically with its XACK)."""
        await self._dead_letter(entry, reason)

    async def _dead_letter(self, entry: Entry, reason: str) -> None:
        record: dict[str, Any] = {
            "source": self.stream,
            "source_id": entry.id,
            "group": self.group,
            "consumer": self.consumer,
            "deliveries": entry.deliveries,
            "reason": reason[:2000],
            "at": repr(time.time()),
        }
        inline = self.config.deadletter_inline_bytes
        for k, v in entry.fields.items():
            v = v if isinstance(v, bytes) else str(v).encode()
            if len(v) <= inline:
                record[_DL_PREFIX + _s(k)] = v
            else:  # a reference, not the payload: an oversized entry must not be copied
                record[f"size:{_s(k)}"] = len(v)
                record[f"prefix:{_s(k)}"] = v[:256]
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xadd(self.deadletter_stream, record, maxlen=self.config.deadletter_cap, approximate=True)
            pipe.xack(self.stream, self.group, entry.id)
            await pipe.execute()
        self._held.discard(entry.id)

    async def keep_alive(self, ids: Iterable[str]) -> list[str]:
        """Reset the idle time of entries this consumer still owns (XCLAIM JUSTID, which
        does not count as a delivery); returns the ids it still owned (none, where Redis lost the group)."""
        ids = list(ids)
        if not ids:
            return []
        return await self._or_regroup(lambda: self._keep_alive(ids), [])

    async def _keep_alive(self, ids: list[str]) -> list[str]:
        # Only entries still ours: another janitor may have claimed one meanwhile, and
        # claiming it back would only make a third copy of the work.
        async with self.redis.pipeline(transaction=False) as pipe:
            for i in ids:
                pipe.xpending_range(self.stream, self.group, min=i, max=i, count=1)
            rows = await pipe.execute()
        mine = [i for i, r in zip(ids, rows) if r and _s(r[0]["consumer"]) == self.consumer]
        if not mine:
            return []
        return [_s(i) for i in await self.redis.xclaim(self.stream, self.group, self.consumer, 0, mine, justid=True)]

    # ------------------------------------------------------------ janitor

    async def janitor(self) -> JanitorReport:
        """One bounded pass: queue this consumer's own pending entries (once, at start),
        claim idle entries of other (presumably dead) consumers, dead-letter those over
        `max_deliveries`, trim what every group has acked."""
        return await self._or_regroup(self._janitor, JanitorReport())

    async def _janitor(self) -> JanitorReport:
        cfg = self.config
        self._last_janitor = time.monotonic()
        if not self._group_ready:
            await self.ensure_group()
        recovered = claimed = dead = 0
        if self._backlog_cursor is not None:
            # Own pending entries first, or re-reading them later would count a delivery
            # for entries claimed below as well. Claim from others once they are queued.
            got = await self._read_backlog(cfg.janitor_count)
            self._claimed.extend(got)
            recovered = len(got)
            if self._backlog_cursor is not None:
                trimmed = await self._trim() if cfg.trim else 0
                return JanitorReport(recovered=recovered, trimmed=trimmed)
        rows = await self.redis.xpending_range(
            self.stream, self.group, min=self._scan_from, max="+", count=cfg.janitor_count, idle=cfg.claim_idle_ms
        )
        self._scan_from = "-" if len(rows) < cfg.janitor_count else "(" + _s(rows[-1]["message_id"])
        prior = {
            _s(r["message_id"]): int(r["times_delivered"])
            for r in rows
            if not (_s(r["consumer"]) == self.consumer and _s(r["message_id"]) in self._held)
        }
        if prior:
            # XCLAIM re-checks the idle time, so of two janitors racing only one wins.
            got = await self.redis.xclaim(self.stream, self.group, self.consumer, cfg.claim_idle_ms, list(prior))
            for sid, fields in got:
                sid = _s(sid)
                if not fields:
                    continue
                entry = Entry(sid, fields, prior[sid] + 1)
                if entry.deliveries > cfg.max_deliveries:
                    self.counters.dead_lettered += 1
                    await self._dead_letter(entry, self._too_many(entry))
                    dead += 1
                else:
                    self._held.add(sid)
                    self._claimed.append(entry)
                    claimed += 1
        trimmed = await self._trim() if cfg.trim else 0
        return JanitorReport(recovered=recovered, claimed=claimed, dead_lettered=dead, trimmed=trimmed)

    async def _trim(self) -> int:
        """XTRIM MINID below the oldest entry any group still needs: its oldest pending
        entry, or the one after its last delivered entry."""
        try:
            groups = await self.redis.xinfo_groups(self.stream)
        except ResponseError:
            return 0
        if not groups:
            return 0
        keep_from = []
        for g in groups:
            summary = await self.redis.xpending(self.stream, g["name"])
            if int(summary["pending"]) > 0:
                keep_from.append(_s(summary["min"]))
            else:
                keep_from.append(_next_id(_s(g["last-delivered-id"])))
        minid = min(keep_from, key=_id_key)
        return int(await self.redis.xtrim(self.stream, minid=minid, approximate=False))


# ---------------------------------------------------------------- typed queues


@dataclass(frozen=True)
class PromptRecord:
    stream_id: str
    deliveries: int
    group: PromptGroup


@dataclass(frozen=True)
class TrajectoryRecord:
    stream_id: str
    deliveries: int
    trajectory: Trajectory


@dataclass
class Counters:
    """What a typed queue dropped on its own (for metrics)."""

    malformed: int = 0  # undecodable entries sent to the dead-letter stream
    unsigned: int = 0  # entries without a valid signature (the run has a secret), dead-lettered
    duplicates: int = 0  # samples already committed or already held, acked and dropped
    dead_lettered: int = 0  # entries delivered more than max_deliveries times, dead-lettered
    regrouped: int = 0  # times Redis had lost the stream or its group (NOGROUP) and the group was made again


class _TypedStream:
    """What the two typed streams share: one stream, its consumer group, and an optional
    consumer (producers need none)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        stream: str,
        group: str,
        *,
        consumer: str | None,
        config: StreamConfig,
        limits: CodecLimits,
        signer: Signer | None = None,
    ):
        self.redis, self.keys, self.limits, self.config, self.signer = redis, keys, limits, config, signer
        self.stream, self.group = stream, group
        self.consumer = (
            None
            if consumer is None
            else GroupConsumer(
                redis, stream=stream, group=group, consumer=consumer, deadletter=keys.deadletter, config=config
            )
        )
        self.counters = Counters() if self.consumer is None else self.consumer.counters

    def _need_consumer(self) -> GroupConsumer:
        if self.consumer is None:
            raise ValueError(f"this {type(self).__name__} has no consumer name (pass consumer=...)")
        return self.consumer

    async def setup(self) -> None:
        await ensure_group(self.redis, self.stream, self.group)

    async def keep_alive(self, records: Iterable[PromptRecord | TrajectoryRecord]) -> list[str]:
        return await self._need_consumer().keep_alive(r.stream_id for r in records)

    async def janitor(self) -> JanitorReport:
        return await self._need_consumer().janitor()

    async def stats(self) -> dict[str, Any]:
        return await stream_stats(self.redis, self.stream)


class PromptQueue(_TypedStream):
    """The prompts stream. Producers `add()` prompt groups (signed, with a signer); a rollout worker
    (consumer name = its worker id) `read()`s them and calls `complete()` with the trajectories,
    which XADDs them and XACKs the prompt in one transaction. With a signer, `read()` refuses an
    entry without a valid prompt signature; undecodable entries are refused too: each is
    dead-lettered alone with its reason (and acked, so it never comes back) and counted."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        *,
        consumer: str | None = None,
        config: StreamConfig = StreamConfig(),
        limits: CodecLimits = DEFAULT_LIMITS,
        signer: Signer | None = None,  # signs what add() and complete() add; read() checks prompt signatures
    ):
        super().__init__(
            redis, keys, keys.prompts, PROMPTS_GROUP, consumer=consumer, config=config, limits=limits, signer=signer
        )

    async def add(self, groups: Sequence[PromptGroup]) -> list[str]:
        payloads = [encode_prompt_group(g, self.limits) for g in groups]
        return await add_entries(self.redis, self.keys.prompts, payloads, self.signer, PROMPT)

    async def read(self, count: int | None = None, block_ms: int | None = None) -> list[PromptRecord]:
        c = self._need_consumer()
        out = []
        for e in await c.read(count, block_ms):
            refusal = signature_refusal(e.fields, self.signer, PROMPT)
            if refusal is not None:
                self.counters.unsigned += 1
                await c.dead_letter(e, refusal)
                continue
            try:
                out.append(PromptRecord(e.id, e.deliveries, decode_prompt_group(e.fields.get(DATA_FIELD), self.limits)))
            except CodecError as err:
                self.counters.malformed += 1
                await c.dead_letter(e, f"decode: {err}")
        return out

    async def complete(self, record: PromptRecord, trajectories: Sequence[Trajectory]) -> list[str]:
        """XADD the group's trajectories and XACK the prompt atomically (MULTI/EXEC)."""
        c = self._need_consumer()
        payloads = [encode_trajectory(t, self.limits) for t in trajectories]
        async with self.redis.pipeline(transaction=True) as pipe:
            for p in payloads:
                pipe.xadd(self.keys.trajectories, _signed_fields(p, self.signer))
            pipe.xack(self.keys.prompts, PROMPTS_GROUP, record.stream_id)
            result = await pipe.execute()
        c.release([record.stream_id])
        return [_s(i) for i in result[:-1]]

    async def ack(self, records: Iterable[PromptRecord]) -> int:
        return await self._need_consumer().ack(r.stream_id for r in records)

    async def dead_letter(self, record: PromptRecord, reason: str) -> None:
        """Refuse a prompt for good (it cannot run here), with the reason; acked with it."""
        c = self._need_consumer()
        fields = {DATA_FIELD: encode_prompt_group(record.group, self.limits)}  # a worker signs no prompt
        await c.dead_letter(Entry(record.stream_id, fields, record.deliveries), reason)


# SET NX EX every idempotency key and XACK the entries, atomically and in one round trip
# (a MULTI of 2N commands costs the client N times more parsing). KEYS[1] = stream,
# KEYS[2..] = idempotency keys; ARGV[1] = group, ARGV[2] = TTL, ARGV[3..] = stream ids.
_COMMIT = """
local new = 0
for i = 2, #KEYS do
  if redis.call('SET', KEYS[i], '1', 'NX', 'EX', ARGV[2]) then new = new + 1 end
end
redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 3))
return new
"""
_COMMIT_CHUNK = 1000  # well under Lua's unpack() limit


class TrajectoryStream(_TypedStream):
    """The trajectories stream. Rollout workers `add()`; the trainer (consumer name =
    its id) `read()`s records with their stream ids, and after its optimizer step and
    checkpoint calls `commit()` (idempotency keys + XACK in one transaction).

    Checkpoints store `[(stream_id, sample_id), ...]` of the samples a step used; after
    restoring one, call `commit_ids()` with them before the first `read()`, so a crash
    between checkpoint and commit neither loses nor repeats a sample.
    """

    SCOPE = "trainer"

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        *,
        consumer: str | None = None,
        config: StreamConfig = StreamConfig(),
        limits: CodecLimits = DEFAULT_LIMITS,
        signer: Signer | None = None,  # signs what add() adds; read() refuses entries without a valid tag
    ):
        super().__init__(
            redis,
            keys,
            keys.trajectories,
            TRAJECTORIES_GROUP,
            consumer=consumer,
            config=config,
            limits=limits,
            signer=signer,
        )
        self._held_samples: dict[str, str] = {}  # sample_id -> stream_id, read but not committed

    async def add(self, trajectories: Sequence[Trajectory]) -> list[str]:
        return await add_entries(
            self.redis, self.keys.trajectories, [encode_trajectory(t, self.limits) for t in trajectories], self.signer
        )

    async def read(
        self,
        count: int | None = None,
        block_ms: int | None = None,
        *,
        admit: Callable[[TrajectoryRecord], bool] | None = None,
    ) -> list[TrajectoryRecord]:
        """Fresh records only: undecodable entries go to the dead-letter stream, samples
        already committed or already held by this reader are acked and counted as duplicates.

        `admit` (the caller's validation) sees each decoded record first; one it refuses (False: the
        caller settles it itself, e.g. dead-letters it) is never held and never makes another copy
        of its sample id a duplicate, not even one later in the same batch."""
        c = self._need_consumer()
        decoded: list[TrajectoryRecord] = []
        for e in await c.read(count, block_ms):
            refusal = signature_refusal(e.fields, self.signer, TRAJECTORY)
            if refusal is not None:
                self.counters.unsigned += 1
                await c.dead_letter(e, refusal)
                continue
            try:
                decoded.append(
                    TrajectoryRecord(e.id, e.deliveries, decode_trajectory(e.fields.get(DATA_FIELD), self.limits))
                )
            except CodecError as err:
                self.counters.malformed += 1
                await c.dead_letter(e, f"decode: {err}")
        # One MGET for the whole batch: a key that exists marks a committed sample.
        seen = await self.redis.mget([self._seen_key(r) for r in decoded]) if decoded else []
        fresh, duplicates = [], []
        for r, was_seen in zip(decoded, seen):
            if was_seen or r.trajectory.sample_id in self._held_samples:  # held: an earlier copy, maybe this batch's
                duplicates.append(r.stream_id)
            elif admit is None or admit(r):
                self._held_samples[r.trajectory.sample_id] = r.stream_id
                fresh.append(r)
        if duplicates:
            self.counters.duplicates += len(duplicates)
            await c.ack(duplicates)
        return fresh

    async def commit(self, records: Iterable[TrajectoryRecord]) -> int:
        """Mark the samples used and XACK them (atomically); returns how many were newly marked."""
        return await self.commit_ids([(r.stream_id, r.trajectory.sample_id) for r in records])

    async def commit_ids(self, pairs: Sequence[tuple[str, str]]) -> int:
        """`commit` from `(stream_id, sample_id)` pairs, e.g. as stored in a checkpoint."""
        marked = 0
        for i in range(0, len(pairs), _COMMIT_CHUNK):
            chunk = pairs[i : i + _COMMIT_CHUNK]
            marked += int(
                await run_script(
                    self.redis,
                    _COMMIT,
                    keys=[self.keys.trajectories] + [self.keys.idempotency(self.SCOPE, s) for _, s in chunk],
                    args=[TRAJECTORIES_GROUP, self.config.idempotency_ttl_s] + [sid for sid, _ in chunk],
                )
            )
        for _, sample_id in pairs:
            self._held_samples.pop(sample_id, None)
        if self.consumer is not None:
            self.consumer.release(sid for sid, _ in pairs)
        return marked

    def forget(self, record: TrajectoryRecord) -> None:
        """Stop treating `record`'s sample id as held (it was refused; a later copy may be the real one)."""
        if self._held_samples.get(record.trajectory.sample_id) == record.stream_id:
            del self._held_samples[record.trajectory.sample_id]

    def _seen_key(self, record: TrajectoryRecord) -> str:
        return self.keys.idempotency(self.SCOPE, record.trajectory.sample_id)

    async def dead_letter(self, record: TrajectoryRecord, reason: str) -> None:
        """Reject a sample for good (e.g. a contract fingerprint mismatch), with the reason."""
        c = self._need_consumer()
        fields = _signed_fields(encode_trajectory(record.trajectory, self.limits), self.signer)
        await c.dead_letter(Entry(record.stream_id, fields, record.deliveries), reason)
        self.forget(record)  # only if that id is still this entry's (a real copy may be held under it)

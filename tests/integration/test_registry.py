"""broker.registry against a real redis-server: policy:latest, announce, heartbeats."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from broker.keys import Keys
from broker.registry import Heartbeats, PolicyPointer, PolicyRegistry
from broker.signing import Signer
from broker.streams import connect


def ptr(version: int, address: str = "127.0.0.1:50051", fp: str = "fp-a") -> PolicyPointer:
    return PolicyPointer(version=version, address=address, contract_fingerprint=fp)


async def test_policy_latest_moves_only_forward(redis_url, run_id):
    async with connect(redis_url) as r:
        reg = PolicyRegistry(r, Keys(run_id=run_id))
        assert await reg.latest() is None
        assert await reg.publish(ptr(1))
        assert await reg.publish(ptr(3))
        assert not await reg.publish(ptr(2))  # older: refused, nothing changes
        latest = await reg.latest()
        assert (latest.version, latest.address, latest.contract_fingerprint) == (3, "127.0.0.1:50051", "fp-a")
        assert abs(latest.published_at - time.time()) < 60
        # same version, same contract, new address (restarted policy server): accepted
        assert await reg.publish(ptr(3, address="127.0.0.1:50052"))
        assert (await reg.latest()).address == "127.0.0.1:50052"
        with pytest.raises(ValueError, match="another contract fingerprint"):
            await reg.publish(ptr(3, fp="fp-b"))
        assert (await reg.latest()).contract_fingerprint == "fp-a"


def test_policy_pointer_validation_names_every_bad_value():
    with pytest.raises(ValueError) as e:
        PolicyPointer(version=-1, address="", contract_fingerprint="a b")
    assert (
        "version=-1" in str(e.value) and "address=''" in str(e.value) and "contract_fingerprint='a b'" in str(e.value)
    )


async def test_announce_wakes_watchers_without_waiting_for_the_poll(redis_url, run_id):
    async with connect(redis_url) as r:
        keys = Keys(run_id=run_id)
        reg = PolicyRegistry(r, keys)
        await reg.publish(ptr(1))
        async with contextlib.aclosing(reg.watch(poll_s=30)) as versions:  # poll far too slow to matter
            assert (await asyncio.wait_for(anext(versions), 5)).version == 1  # current one first
            t0 = time.monotonic()
            publisher = asyncio.create_task(_publish_later(reg, ptr(2), 0.1))
            assert (await asyncio.wait_for(anext(versions), 5)).version == 2
            assert time.monotonic() - t0 < 5
            await publisher


async def _publish_later(reg: PolicyRegistry, p: PolicyPointer, delay: float) -> None:
    await asyncio.sleep(delay)
    assert await reg.publish(p)


async def test_a_missed_announcement_is_caught_by_polling(redis_url, run_id):
    async with connect(redis_url) as r:
        keys = Keys(run_id=run_id)
        reg = PolicyRegistry(r, keys)
        async with contextlib.aclosing(reg.watch(after_version=4, poll_s=0.2)) as versions:
            waiter = asyncio.create_task(anext(versions))
            await asyncio.sleep(0.1)
            # written without PUBLISH, as if the message had been lost
            await r.hset(
                keys.policy_latest,
                mapping={"version": 5, "address": "h:1", "contract_fingerprint": "fp", "published_at": 1.0},
            )
            got = await asyncio.wait_for(waiter, 5)
            assert (got.version, got.address) == (5, "h:1")


async def test_wait_for_returns_a_new_enough_version_or_times_out(redis_url, run_id):
    async with connect(redis_url) as r:
        reg = PolicyRegistry(r, Keys(run_id=run_id))
        await reg.publish(ptr(2))
        assert (await reg.wait_for(2, timeout_s=5)).version == 2
        with pytest.raises(asyncio.TimeoutError):
            await reg.wait_for(3, timeout_s=0.3, poll_s=0.1)


async def test_heartbeats_expire(redis_url, run_id):
    async with connect(redis_url) as r:
        keys = Keys(run_id=run_id)
        hb = Heartbeats(r, keys)
        await hb.beat("w0", ttl_s=0.3, role="rollout", info={"version": 3})
        await hb.beat("w1", ttl_s=30, role="rollout")
        await hb.beat("trainer-0", ttl_s=30, role="trainer")
        live = await hb.live()
        assert sorted(live) == ["trainer-0", "w0", "w1"]
        assert live["w0"]["info"] == {"version": 3} and live["w0"]["role"] == "rollout"
        assert sorted(await hb.live(role="rollout")) == ["w0", "w1"]
        await asyncio.sleep(0.45)
        assert sorted(await hb.live()) == ["trainer-0", "w1"]
        assert sorted(m.decode() for m in await r.smembers(keys.workers)) == ["trainer-0", "w1"]  # pruned
        await hb.remove("w1")
        assert sorted(await hb.live()) == ["trainer-0"]
        with pytest.raises(ValueError, match="worker_id"):
            await hb.beat("bad id", ttl_s=1, role="rollout")


async def test_heartbeat_loop_beats_until_stopped_then_disappears(redis_url, run_id):
    async with connect(redis_url) as r:
        hb = Heartbeats(r, Keys(run_id=run_id))
        stop = asyncio.Event()
        calls = []
        task = asyncio.create_task(
            hb.run(
                "w7",
                role="rollout",
                stop=stop,
                interval_s=0.05,
                ttl_s=0.2,
                info=lambda: {"n": len(calls.append(1) or calls)},
            )
        )
        await asyncio.sleep(0.4)  # longer than the TTL: only repeated beats keep it alive
        live = await hb.live()
        assert "w7" in live and live["w7"]["info"]["n"] >= 3
        stop.set()
        await asyncio.wait_for(task, 5)
        assert await hb.live() == {}


async def test_the_relay_tree_travels_signed_with_the_pointer(redis_url, run_id):
    """fanout and relays round-trip through policy:latest, signed with the rest: each member's
    sources are its ancestors' relays, then the trainer; a relay address rewritten in Redis fails
    the signature, so the pointer is refused."""
    signer = Signer(b"k" * 32)
    members = tuple((f"w{i}", f"10.0.0.{i}:7000") for i in range(6))
    pointer = PolicyPointer(
        version=4, address="trainer:50051", contract_fingerprint="fp-a", content_digest="ab" * 32, fanout=2,
        relays=members,
    )  # fmt: skip
    async with connect(redis_url) as r:
        keys = Keys(run_id=run_id)
        reg = PolicyRegistry(r, keys, signer)
        assert await reg.publish(pointer)
        got = await reg.latest()
        assert (got.fanout, got.relays) == (2, members)
        assert got.sources("w0") == ["trainer:50051"]
        assert got.sources("w4") == ["10.0.0.1:7000", "trainer:50051"]
        # Joined since: seeded from a peer (sha256("w9") % 6 == 5: w5, then w5's sources).
        assert got.sources("w9") == ["10.0.0.5:7000", "10.0.0.1:7000", "trainer:50051"]
        await r.hset(keys.policy_latest, "relays", '[["w0","evil:1"]]')
        assert await reg.latest() is None and reg.refused == 1


def test_relay_trees_are_validated():
    base = {"version": 1, "address": "a:1", "contract_fingerprint": "fp"}
    for fanout, relays, says in (
        (0, (("w0", "a:2"),), "relays without a fanout degree"),
        (65, (), r"fanout=65 \(want an int in \[0, 64\]\)"),
        (2, (("w0", "a:2"), ("w0", "a:3")), "a worker named twice"),
        (2, (("w0", "a 2"),), "is not a \\(worker id, address\\) pair"),
    ):
        with pytest.raises(ValueError, match=says):
            PolicyPointer(**base, fanout=fanout, relays=relays)
    assert PolicyPointer(**base).sources("w0") == ["a:1"]

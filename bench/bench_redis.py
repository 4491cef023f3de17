"""Trajectories per second through Redis, against baselines measured in the same run.

Measured paths (N trajectories of `--completion` tokens + `--prompt` prompt tokens each,
moved in batches of `--batch`, on a private redis-server unless --url is given):

  codec   encode + decode only (no network)                         -> CPU ceiling
  raw     XADD pipelined + XREADGROUP + XACK of opaque bytes of the
          same size                                                 -> Redis ceiling
  stream  encode + XADD pipelined + XREADGROUP + decode + XACK
          (GroupConsumer, no idempotency check)
  full    TrajectoryStream.add + read (decode + idempotency MGET)
          + commit (SET NX EX + XACK in one Lua call): what the trainer pays

Each path runs `--repeats` times on fresh keys; the median is reported. Producer and
consumer run one after the other in one asyncio loop (uvloop), so the numbers are
per-core costs; on 2 cores redis-server gets the other one.

Usage: python bench/bench_redis.py [--n 5000] [--completion 1000] [--url redis://...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from broker.codec import Trajectory, decode_trajectory, encode_trajectory, sample_id_for
from broker.keys import TRAJECTORIES_GROUP, Keys
from broker.local_redis import LocalRedis, LocalRedisConfig
from broker.streams import (
    DATA_FIELD,
    GroupConsumer,
    StreamConfig,
    TrajectoryStream,
    add_entries,
    connect,
    ensure_group,
    run_async,
)

QUIET = StreamConfig(janitor_every_s=0, block_ms=0, read_count=10_000)


def make_trajectories(n: int, prompt_len: int, completion_len: int) -> list[Trajectory]:
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 150_000, prompt_len)
    out = []
    for i in range(n):
        group = f"g{i // 8}"
        out.append(
            Trajectory(
                sample_id=sample_id_for(group, i % 8),
                prompt_id=f"p{i // 8}",
                group_id=group,
                sample_index=i % 8,
                group_size=8,
                prompt_tokens=prompt,
                completion_tokens=rng.integers(0, 150_000, completion_len),
                behavior_logprobs=-rng.random(completion_len, dtype=np.float32),
                reward=float(i % 2),
                policy_version=1,
                contract_fingerprint="0" * 64,
                worker_id="bench",
                created_at=time.time(),
                info={"finish_reason": "stop"},
            )
        )
    return out


def bench_codec(trajs: list[Trajectory], batch: int) -> float:
    t0 = time.perf_counter()
    for t in trajs:
        decode_trajectory(encode_trajectory(t))
    return time.perf_counter() - t0


async def bench_raw(r, payloads: list[bytes], batch: int) -> float:
    keys = Keys(run_id="bench-" + uuid.uuid4().hex[:8])
    await ensure_group(r, keys.trajectories, TRAJECTORIES_GROUP)
    t0 = time.perf_counter()
    for i in range(0, len(payloads), batch):
        await add_entries(r, keys.trajectories, payloads[i : i + batch])
    got = 0
    while got < len(payloads):
        resp = await r.xreadgroup(TRAJECTORIES_GROUP, "c", {keys.trajectories: ">"}, count=batch)
        entries = resp[0][1]
        got += len(entries)
        await r.xack(keys.trajectories, TRAJECTORIES_GROUP, *[i for i, _ in entries])
    dt = time.perf_counter() - t0
    await r.delete(keys.trajectories)
    return dt


async def bench_stream(r, trajs: list[Trajectory], batch: int) -> float:
    keys = Keys(run_id="bench-" + uuid.uuid4().hex[:8])
    c = GroupConsumer(
        r, stream=keys.trajectories, group=TRAJECTORIES_GROUP, consumer="c", deadletter=keys.deadletter, config=QUIET
    )
    await c.ensure_group()
    t0 = time.perf_counter()
    for i in range(0, len(trajs), batch):
        await add_entries(r, keys.trajectories, [encode_trajectory(t) for t in trajs[i : i + batch]])
    got = 0
    while got < len(trajs):
        entries = await c.read(count=batch)
        decoded = [decode_trajectory(e.fields[DATA_FIELD]) for e in entries]
        got += len(decoded)
        await c.ack([e.id for e in entries])
    dt = time.perf_counter() - t0
    await r.delete(keys.trajectories)
    return dt


async def bench_full(r, trajs: list[Trajectory], batch: int) -> float:
    keys = Keys(run_id="bench-" + uuid.uuid4().hex[:8])
    ts = TrajectoryStream(r, keys, consumer="trainer", config=QUIET)
    await ts.setup()
    t0 = time.perf_counter()
    for i in range(0, len(trajs), batch):
        await ts.add(trajs[i : i + batch])
    got = 0
    while got < len(trajs):
        recs = await ts.read(count=batch)
        got += len(recs)
        await ts.commit(recs)
    dt = time.perf_counter() - t0
    assert ts.counters.duplicates == 0 and ts.counters.malformed == 0
    await r.delete(keys.trajectories)
    async for k in r.scan_iter(match=keys.prefix + "*", count=1000):
        await r.delete(k)
    return dt


async def run(args: argparse.Namespace, url: str) -> dict:
    trajs = make_trajectories(args.n, args.prompt, args.completion)
    payloads = [encode_trajectory(t) for t in trajs]
    size = statistics.mean(len(p) for p in payloads)
    times: dict[str, list[float]] = {"codec": [], "raw": [], "stream": [], "full": []}
    async with connect(url) as r:
        for _ in range(args.repeats):
            times["codec"].append(bench_codec(trajs, args.batch))
            times["raw"].append(await bench_raw(r, payloads, args.batch))
            times["stream"].append(await bench_stream(r, trajs, args.batch))
            times["full"].append(await bench_full(r, trajs, args.batch))
    rate = {k: args.n / statistics.median(v) for k, v in times.items()}
    return {"n": args.n, "bytes_per_trajectory": size, "batch": args.batch, "per_s": rate}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=5000)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--completion", type=int, default=1000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--url", default=None, help="use this Redis instead of starting a private one")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args()
    if args.n < args.batch or args.batch < 1 or args.repeats < 1:
        p.error("want n >= batch >= 1 and repeats >= 1")

    if args.url:
        res = run_async(run(args, args.url))
    else:
        with tempfile.TemporaryDirectory() as tmp, LocalRedis(LocalRedisConfig(workdir=Path(tmp))) as url:
            res = run_async(run(args, url))

    r = res["per_s"]
    print(
        f"{args.n} trajectories x ({args.prompt} prompt + {args.completion} completion tokens), "
        f"{res['bytes_per_trajectory']:.0f} B each, batch {args.batch}, median of {args.repeats}"
    )
    print(f"{'path':8} {'traj/s':>10} {'MB/s':>8}")
    for k in ("codec", "raw", "stream", "full"):
        print(f"{k:8} {r[k]:10.0f} {r[k] * res['bytes_per_trajectory'] / 1e6:8.1f}")
    print(f"stream / raw  = {r['stream'] / r['raw']:.2f}  (codec + consumer bookkeeping overhead on the Redis path)")
    print(
        f"full   / raw  = {r['full'] / r['raw']:.2f}  (plus idempotency MGET on read and SET NX EX + XACK script on commit)"
    )
    print(f"full   / codec = {r['full'] / r['codec']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""An oversized entry is dead-lettered as a reference (size and first bytes),
not copied; one read pulls at most max_read_bytes // max_entry_bytes entries; the dead-letter
stream's length is capped by bytes as well as by count."""

from __future__ import annotations

import pytest

from broker.keys import Keys
from broker.streams import DATA_FIELD, StreamConfig, TrajectoryStream, add_entries, connect, read_deadletter

pytestmark = pytest.mark.integration


async def test_an_oversized_entry_is_dead_lettered_by_reference(redis_url, run_id):
    keys = Keys(run_id=run_id)
    async with connect(redis_url) as r:
        stream = TrajectoryStream(r, keys, consumer="trainer")
        await stream.setup()
        big = b"\x93" + b"x" * (6 << 20)  # over the codec's 4 MiB
        await add_entries(r, keys.trajectories, [big])
        assert await stream.read(block_ms=10) == []
        assert stream.counters.malformed == 1
        [dl] = await read_deadletter(r, keys)
        assert "bytes > limit" in dl.reason
        assert dl.fields == {} and dl.oversized == {DATA_FIELD: (len(big), big[:256])}
        assert await r.memory_usage(keys.deadletter) < 64 << 10  # the 6 MiB were not copied


async def test_a_read_pulls_a_bounded_number_of_bytes(redis_url, run_id):
    keys = Keys(run_id=run_id)
    cfg = StreamConfig(read_count=256, max_entry_bytes=1 << 20, max_read_bytes=3 << 20)
    assert cfg.max_read_count == 3
    async with connect(redis_url) as r:
        stream = TrajectoryStream(r, keys, consumer="trainer", config=cfg)
        await stream.setup()
        await add_entries(r, keys.trajectories, [b"\x93bad"] * 10)
        await stream.read(block_ms=10)
        assert stream.counters.malformed == 3  # 3 of the 10 entries were read


def test_the_deadletter_cap_counts_bytes():
    assert StreamConfig().deadletter_cap == (64 << 20) // ((16 << 10) + 1024)
    assert StreamConfig(deadletter_maxlen=10).deadletter_cap == 10
    with pytest.raises(ValueError, match="max_read_bytes"):
        StreamConfig(max_read_bytes=1, max_entry_bytes=2)

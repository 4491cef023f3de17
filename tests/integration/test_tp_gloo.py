"""Per-token activation scales under real torch.distributed TP groups (gloo on 127.0.0.1).

One spawn of 4 processes holds TP groups of 1 ([r]), 2 ([0, 1] and [2, 3]) and 4 (all):
- `global` mode: every rank's bytes are the slice of the TP=1 quantization, so gathering the
  shards gives bitwise the TP=1 result for every TP size;
- `shard` mode: local scales differ from TP=1 (the data is built so they must), and a group
  whose size differs from the contract's partition is refused on every rank alike;
- a non-finite value on one rank makes every rank raise (no rank left waiting in a collective).
"""

from __future__ import annotations

import multiprocessing as mp
import traceback

import gloo  # tests/gloo.py: conftest.py puts tests/ on sys.path
import pytest
import torch

WORLD = 4
TOKENS, K = 6, 256
TIMEOUT_S = 60


def _activation() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(TOKENS, K, generator=g)
    # Each token's amax sits in a different rank's quarter of K, with a large dynamic range,
    # so local (shard) amaxes differ from the row amax on every rank.
    for t in range(TOKENS):
        x[t, (t % WORLD) * (K // WORLD) + 3] = 40.0 * (t + 1)
    return x.to(torch.bfloat16)


def _to_bytes(t: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...], bytes]:
    """A tensor as plain bytes for the queue: torch tensors travel as shared file descriptors, which
    a child that exits before the parent reads them takes along (ConnectionResetError under load)."""
    return t.dtype, tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes()


def _from_bytes(item: tuple[torch.dtype, tuple[int, ...], bytes]) -> torch.Tensor:
    dtype, shape, data = item
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def _worker(rank: int, port: int, out: mp.Queue) -> None:
    try:
        import torch.distributed as dist

        from policy import formats
        from policy.tp import quantize_activation

        gloo.init(rank, port, WORLD, timeout_s=30)
        # Every rank creates every group, in the same order: TP groups of 1, 2 and 4 processes.
        singles = [dist.new_group([r]) for r in range(WORLD)]
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        x = _activation()
        ref = formats.nvfp4.quantize(x, scope="row")
        result = {}
        for tps, group in ((1, singles[rank]), (2, pairs[rank // 2]), (4, dist.group.WORLD)):
            r = rank % tps
            w = K // tps
            xl = x[:, r * w : (r + 1) * w]
            q = quantize_activation(
                xl,
                fmt="nvfp4",
                scope="row",
                tp_scale_mode="global",
                group=group,
                site="model.layers.0.mlp.experts.0.down_proj.input",
            )
            # The slice of the TP=1 quantization, byte for byte.
            result[("global_equal", tps)] = (
                torch.equal(q.codes, ref.codes[:, r * w // 2 : (r + 1) * w // 2])
                and torch.equal(
                    q.block_scales.view(torch.uint8),
                    ref.block_scales[:, r * w // 16 : (r + 1) * w // 16].view(torch.uint8),
                )
                and torch.equal(q.global_scale, ref.global_scale)
            )
            result[("parts", tps)] = {k: _to_bytes(v) for k, v in q.parts().items()}
            s = quantize_activation(
                xl, fmt="nvfp4", scope="row", tp_scale_mode="shard", group=group, partition_tp_size=tps
            )
            result[("shard_scales_equal_tp1", tps)] = torch.equal(s.global_scale, ref.global_scale)
            try:
                quantize_activation(
                    xl,
                    fmt="nvfp4",
                    scope="row",
                    tp_scale_mode="shard",
                    group=group,
                    partition_tp_size=2 if tps != 2 else 4,
                )
                result[("mismatch_refused", tps)] = ""
            except ValueError as e:
                result[("mismatch_refused", tps)] = str(e)
        bad = x[:, rank * 64 : (rank + 1) * 64].clone()
        if rank == 3:
            bad[0, 0] = float("nan")
        try:
            quantize_activation(bad, fmt="nvfp4", scope="row", group=dist.group.WORLD)
            result["nonfinite_raised"] = False
        except ValueError:
            result["nonfinite_raised"] = True
        dist.destroy_process_group()
        out.put((rank, result, None))
    except BaseException:
        out.put((rank, None, traceback.format_exc()))


@pytest.mark.slow
@pytest.mark.integration
def test_global_scales_are_bitwise_tp_invariant_and_shard_mismatch_is_refused(free_port):
    results = gloo.run_ranks(_worker, world=WORLD, port=free_port(), timeout_s=TIMEOUT_S, what="TP workers")
    for result in results.values():
        for key in [k for k in result if k[0] == "parts"]:
            result[key] = {name: _from_bytes(v) for name, v in result[key].items()}

    for rank, res in results.items():
        for tps in (1, 2, 4):
            assert res[("global_equal", tps)], f"rank {rank}, tp_size {tps}: global mode differs from TP=1"
        assert res[("shard_scales_equal_tp1", 1)]
        for tps in (2, 4):
            assert not res[("shard_scales_equal_tp1", tps)], "shard mode should use local amaxes"
        for tps in (1, 2, 4):
            msg = res[("mismatch_refused", tps)]
            assert f"this TP group has tp_size={tps}" in msg, (rank, tps, msg)
        assert res["nonfinite_raised"], f"rank {rank} did not raise on a non-finite value elsewhere"

    # Gathering the shards of every TP size gives the TP=1 bytes.
    tp1 = results[0][("parts", 1)]
    for tps in (2, 4):
        ranks = range(tps)  # ranks 0..tps-1 form one TP group of size tps
        codes = torch.cat([results[r][("parts", tps)]["codes"] for r in ranks], dim=1)
        scales = torch.cat([results[r][("parts", tps)]["block_scales"].view(torch.uint8) for r in ranks], dim=1)
        assert torch.equal(codes, tp1["codes"])
        assert torch.equal(scales, tp1["block_scales"].view(torch.uint8))
        for r in ranks:
            assert torch.equal(results[r][("parts", tps)]["global_scale"], tp1["global_scale"])

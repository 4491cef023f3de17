"""rollout.kernels on a machine without a GPU: packing round-trips, the matmuls fall back to the
reference dequantize + matmul, and MoE routing groups pairs by expert. The Triton kernels
themselves are checked on the GPU by tests/gpu."""

from __future__ import annotations

import pytest
import torch
from mixed_formats import same_parts as _same  # tests/mixed_formats.py (conftest puts tests/ on sys.path)

import rollout.kernels as RK
from policy import compute, formats
from policy.formats import fp8_block, int4, mxfp8, nvfp4
from policy.kernels import bitmath
from rollout.kernels.routing import BLOCK_M, moe_align


def test_packing_errors_name_the_problem():
    with pytest.raises(ValueError, match="scope='tensor'"):
        RK.pack(nvfp4.quantize(torch.randn(4, 32), scope="row"))
    with pytest.raises(ValueError, match="unknown format"):
        RK.PackedLinear("fp3", (1, 1))


# --------------------------------------------------------------------------- packing and matmul


def test_pack_unpack_round_trip():
    w = torch.randn(64, 256)
    for q in (nvfp4.quantize(w, scope="tensor"), int4.quantize(w, group_size=32), int4.quantize(w, group_size=64)):
        p = RK.pack(q)
        assert p.codes.dtype == torch.int32 and p.codes.shape == (64, 32)
        assert _same(RK.unpack(p), q)
    # int4 words hold the compressed-tensors offset-8 nibbles.
    q = int4.quantize(w)
    assert torch.equal(bitmath.unrepack(RK.pack(q).codes).to(torch.int16) - 8, q.codes.to(torch.int16))


def test_reference_qmatmul_is_the_contract_matmul():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 256, generator=g)
    x = torch.randn(5, 256, generator=g).to(torch.bfloat16)
    for q in (nvfp4.quantize(w), int4.quantize(w), mxfp8.quantize(w), formats.bf16.quantize(w)):
        y = RK.qmatmul(x, q)
        assert y.dtype == torch.bfloat16 and y.shape == (5, 48)
        assert torch.equal(y, compute.matmul(compute.plain(x), formats.operand(q), torch.bfloat16))
    # nvfp4: the global scale is applied to the fp32 accumulator of x . (e2m1 x sf)
    q = nvfp4.quantize(w)
    acc = x.float() @ nvfp4.operand(q).values.float().T
    assert torch.equal(RK.qmatmul(x, q), (acc * q.global_scale).to(torch.bfloat16))
    # fp8_block is W8A8: x goes through 1x128 tiles first, on every backend.
    q = fp8_block.quantize(w, block=(128, 128))
    xq = fp8_block.quantize(x, block=(1, 128))
    assert torch.equal(RK.qmatmul(x, q), compute.matmul(formats.operand(xq), formats.operand(q), torch.bfloat16))
    with pytest.raises(ValueError, match=r"x must be \[M, 256\]"):
        RK.qmatmul(x[:, :128], q)


def test_moe_qmatmul_reference_equals_per_token_loop():
    g = torch.Generator().manual_seed(4)
    experts = [nvfp4.quantize(torch.randn(32, 128, generator=g)) for _ in range(6)]
    stack = RK.pack_experts(experts)
    assert stack.num_experts == 6 and stack.codes.shape == (6, 32, 16) and stack.global_scale.shape == (6,)
    x = torch.randn(7, 128, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(7)])
    y = RK.moe_qmatmul(x, stack, ids)
    for t in range(7):
        for j in range(3):
            assert torch.equal(y[t, j], RK.qmatmul(x[t : t + 1], experts[int(ids[t, j])])[0])
    with pytest.raises(ValueError, match="expert ids"):
        RK.moe_qmatmul(x, stack, ids + 6)
    with pytest.raises(ValueError, match="moe_qmatmul"):
        RK.qmatmul(x, stack)
    with pytest.raises(ValueError, match="differ from expert 0"):
        RK.pack_experts([experts[0], nvfp4.quantize(torch.randn(16, 128))])


def test_moe_align_groups_pairs_by_expert_in_blocks():
    g = torch.Generator().manual_seed(5)
    for t, e, topk in [(1, 128, 8), (9, 8, 2), (40, 5, 3)]:
        ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(t)])
        pairs, block_expert, num_blocks, max_blocks = moe_align(ids, e)
        nb = int(num_blocks)
        assert nb <= max_blocks and pairs.shape == (max_blocks * BLOCK_M,)
        seen = []
        for b in range(nb):
            rows = pairs[b * BLOCK_M : (b + 1) * BLOCK_M]
            valid = rows[rows >= 0]
            assert valid.numel() > 0
            assert bool((ids.reshape(-1)[valid.long()] == block_expert[b]).all())  # one expert per block
            assert torch.equal(valid, torch.sort(valid).values)  # stable: pair order kept
            seen += valid.tolist()
        assert sorted(seen) == list(range(t * topk))  # every pair exactly once
        assert bool((pairs[nb * BLOCK_M :] == -1).all())

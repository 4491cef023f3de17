"""GPU kernels == CPU reference, byte for byte (quantizers), and close to the reference
dequantize + matmul (4-bit matmuls). Runs on the device machine only (bench/run_device.sh);
on a machine without CUDA or Triton the whole module is skipped, never counted as passing."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run via bench/run_device.sh)", allow_module_level=True)
pytest.importorskip("triton")

import policy.kernels as K  # noqa: E402
import rollout.kernels as RK  # noqa: E402
from policy import formats  # noqa: E402
from policy.kernels import quant_triton as qt  # noqa: E402
from rollout.kernels import matmul_triton as mt  # noqa: E402

DEV = "cuda"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CASES = {  # format -> list of quantize kwargs
    "nvfp4": [{"scope": "tensor"}, {"scope": "row"}],
    "mxfp8": [{}],
    "int4": [{"group_size": 32}, {"group_size": 128}],
    "fp8_block": [{"block": (128, 128)}, {"block": (1, 128)}],
}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().cpu().view(torch.uint8)


def assert_same_bytes(ref, got, what: str):
    rp, gp = ref.parts(), got.parts()
    assert rp.keys() == gp.keys(), what
    for name in rp:
        r, g = rp[name], gp[name]
        assert r.dtype == g.dtype and r.shape == g.shape, (
            f"{what} {name}: {r.dtype}{tuple(r.shape)} vs {g.dtype}{tuple(g.shape)}"
        )
        rb, gb = _bytes(r), _bytes(g)
        bad = (rb != gb).nonzero()
        assert bad.numel() == 0, (
            f"{what} {name}: {bad.shape[0]} differing entries, first at {bad[0].tolist()}: ref {rb[tuple(bad[0])]} kernel {gb[tuple(bad[0])]}"
        )


def edge_inputs(k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows built to hit the contract's edge cases (ties, ±0, zero blocks and rows, maxima,
    subnormal inputs and scales, huge row-to-row range)."""
    g = torch.Generator().manual_seed(seed)
    fmax = torch.finfo(dtype).max
    tiny = torch.finfo(dtype).smallest_normal
    rows = []
    rows.append(torch.zeros(k))  # all-zero row
    rows.append(torch.full((k,), -0.0))  # -0 row
    r = torch.randn(k, generator=g)
    r[: k // 2] = 0.0
    rows.append(r)  # zero blocks
    rows.append(torch.randint(-24, 25, (k,), generator=g) * 0.25)  # many exact ties
    rows.append(
        torch.randint(-24, 25, (k,), generator=g)
        * 0.25
        * 2.0 ** torch.randint(-6, 7, (k // 16, 1), generator=g).repeat(1, 16).flatten()
    )
    rows.append(torch.full((k,), fmax) * torch.sign(torch.randn(k, generator=g)))  # maximum values
    rows.append(torch.randn(k, generator=g) * fmax / 8)
    rows.append(torch.randn(k, generator=g) * tiny)  # around the smallest normal
    rows.append(torch.randn(k, generator=g) * tiny / 64)  # subnormal inputs
    r = torch.randn(k, generator=g) * tiny / 64
    r[0] = 1.0
    rows.append(r)  # tiny blocks next to a big one
    r = torch.randn(k, generator=g)
    r[::16] = 1e4
    rows.append(r)  # one outlier per block
    r = torch.randn(k, generator=g) * 1e-3
    r[0] = fmax / 2
    rows.append(r)  # blocks whose scale rounds to 0
    for e in (-120, -60, 0, 60, 120):  # huge row-to-row range (fp32 only reaches the extremes)
        rows.append(torch.randn(k, generator=g) * 2.0**e)
    x = torch.stack(rows).to(torch.float32)
    x = torch.nan_to_num(x, posinf=fmax, neginf=-fmax).clamp(-fmax, fmax)
    return x.to(dtype)


def random_inputs(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, 1, generator=g) * 2)
    return x.to(dtype)


def _check(fmt: str, x_cpu: torch.Tensor, kw: dict, what: str):
    ref = formats.get(fmt).quantize(x_cpu, **kw)
    got = K.to_device(K.quantize(fmt, x_cpu.to(DEV), **kw), "cpu")  # int4's parts() packs on the CPU
    assert_same_bytes(ref, got, f"{what} {fmt} {kw} {x_cpu.dtype} {tuple(x_cpu.shape)}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", list(CASES))
def test_edge_cases_match_reference(fmt, dtype):
    for kw in CASES[fmt]:
        for k in (128, 256):
            _check(fmt, edge_inputs(k, dtype, seed=k), kw, "edge")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", list(CASES))
def test_random_shapes_match_reference(fmt, dtype):
    for i, (m, k) in enumerate([(1, 128), (7, 384), (33, 1280), (130, 4096), (3, 12288)]):
        for kw in CASES[fmt]:
            _check(fmt, random_inputs(m, k, dtype, seed=i), kw, "random")


@pytest.mark.parametrize("fmt", list(CASES))
def test_large_input_matches_reference(fmt):
    x = random_inputs(2048, 8192, torch.bfloat16, seed=7)
    for kw in CASES[fmt]:
        _check(fmt, x, kw, "large")


def test_nvfp4_small_k_and_odd_rows():
    for m, k in [(5, 16), (9, 48), (17, 2064)]:
        for scope in ("tensor", "row"):
            _check("nvfp4", random_inputs(m, k, torch.bfloat16, seed=m), {"scope": scope}, "small")


def test_subnormal_global_and_block_scales():
    # amax ~ 1e-36 gives S_enc ~ 2.7e39 -> FLT_MAX and S_dec ~ 2.9e-39 (subnormal); amax
    # ~ 1e-35 gives an unclamped S_enc with a subnormal S_dec; block scales are subnormal too.
    x = torch.randn(4, 256, dtype=torch.float32) * torch.tensor([[1e-36], [1e-35], [3e-38], [1e-44]])
    ref = formats.nvfp4.quantize(x, scope="row")
    assert bool((ref.global_scale < torch.finfo(torch.float32).smallest_normal).any())
    for scope in ("tensor", "row"):
        _check("nvfp4", x, {"scope": scope}, "subnormal")
    for fmt in ("mxfp8", "int4", "fp8_block"):
        _check(fmt, x, CASES[fmt][0], "subnormal")


def test_e4m3_software_path_matches_hardware():
    x = random_inputs(64, 4096, torch.bfloat16, seed=3).to(DEV)
    for sw in (False, True):
        codes, sf, gs, _ = qt.nvfp4_quantize(x, "row", e4m3_sw=sw)
        ref = formats.nvfp4.quantize(x.cpu(), scope="row")
        assert torch.equal(sf.cpu().view(torch.uint8), ref.block_scales.view(torch.uint8))
        assert torch.equal(codes.cpu(), ref.codes)
        mcodes, _, _ = qt.mxfp8_quantize(x, e4m3_sw=sw)
        assert torch.equal(mcodes.cpu().view(torch.uint8), formats.mxfp8.quantize(x.cpu()).codes.view(torch.uint8))


def test_e4m3_conversion_exhaustive_over_bf16():
    """Every finite bf16 value in [-448, 448] and every midpoint between E4M3 values."""
    allb = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    allb = allb[torch.isfinite(allb) & (allb.abs() <= 448)]
    e4 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    e4 = torch.sort(e4[torch.isfinite(e4)].unique()).values
    mids = (e4[1:] + e4[:-1]) / 2
    v = torch.cat([allb, mids, torch.nextafter(mids, torch.tensor(1e9)), torch.nextafter(mids, torch.tensor(-1e9))])
    v = v[: v.numel() // 128 * 128].reshape(-1, 128)
    # fp8_block with block (1, 128) and a row amax of 448 has S = 1: codes are plain casts.
    v[:, 0] = 448.0
    got = K.quantize("fp8_block", v.to(DEV), block=(1, 128))
    assert torch.equal(got.scale_inv.cpu(), torch.ones_like(got.scale_inv.cpu()))
    assert torch.equal(got.codes.cpu().view(torch.uint8), v.to(torch.float8_e4m3fn).view(torch.uint8))


def test_nonfinite_input_raises():
    for fmt, kws in CASES.items():
        for kw in kws:
            x = torch.randn(8, 256, device=DEV, dtype=torch.bfloat16)
            x[3, 17] = float("nan")
            with pytest.raises(ValueError):
                K.quantize(fmt, x, **kw)
            x[3, 17] = float("inf")
            with pytest.raises(ValueError):
                K.quantize(fmt, x, **kw)


def test_backend_is_triton_on_cuda():
    assert K.backend(torch.zeros(1, device=DEV)) == "triton"


@pytest.mark.parametrize("fmt", ["nvfp4", "int4"])
def test_operand_kernels_equal_the_reference_operand(fmt):
    """kernels.operand on CUDA (one Triton pass) == formats.operand on the CPU, bit for bit:
    edge rows (every code, subnormal block scales, zero blocks), random shapes, an [E*N, K] stack."""
    cases = [edge_inputs(256, torch.float32, seed=3)] + [
        random_inputs(m, k, torch.float32, m) for m, k in [(1, 16), (7, 384), (130, 4096)]
    ]
    cases.append(random_inputs(8 * 96, 512, torch.bfloat16, 5))  # 8 experts' rows, as a stacked refill
    for x in cases:
        for kw in CASES[fmt]:
            if x.shape[1] % kw.get("group_size", 16):
                continue
            q = formats.get(fmt).quantize(x, **kw)
            ref = formats.operand(q)
            got = K.operand(K.to_device(q, DEV))
            assert got.values.dtype == torch.bfloat16 and got.values.shape == ref.values.shape
            assert torch.equal(_bytes(got.values), _bytes(ref.values)), f"{fmt} {kw} {tuple(x.shape)}"
            assert (got.scale is None) == (ref.scale is None)
            if ref.scale is not None:
                assert torch.equal(_bytes(got.scale), _bytes(ref.scale))
    empty = formats.get(fmt).quantize(torch.zeros(0, 64), **CASES[fmt][0])
    assert K.operand(K.to_device(empty, DEV)).values.shape == (0, 64)


# --------------------------------------------------------------------------- matmul


def _weights(fmt: str, n: int, k: int, seed: int):
    w = random_inputs(n, k, torch.float32, seed) * 0.02
    q = formats.nvfp4.quantize(w, scope="tensor") if fmt == "nvfp4" else formats.int4.quantize(w, group_size=32)
    return q, RK.pack(K.to_device(q, DEV))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.mark.parametrize("fmt", ["nvfp4", "int4"])
def test_qmatmul_matches_reference_dequant_matmul(fmt):
    for n, k in [(256, 512), (384, 768), (1000, 2048)]:
        q, w = _weights(fmt, n, k, seed=n)
        wd = formats.get(fmt).dequantize(q).to(DEV)
        for m in (1, 3, 16, 17, 64):
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            ref = x.float() @ wd.T
            y = RK.qmatmul(x, w)
            assert y.dtype == torch.bfloat16 and y.shape == (m, n)
            assert torch.isfinite(y).all()
            assert _rel(y, ref) < 8e-3, (fmt, n, k, m, _rel(y, ref))


@pytest.mark.parametrize("k, cfg", [(192, None), (320, None), (2048, (64, 64, 2, 2, 4)), (2048, (64, 64, 2, 4, 8))])
def test_int4_qmatmul_64_wide_k_tiles(k, cfg):
    """K not a multiple of 128 (the default config's K tile halves to 64) and explicit 64-wide
    K tiles, for int4 (nvfp4 refuses them: next test)."""
    q, w = _weights("int4", 256, k, seed=k)
    x = torch.randn(5, k, device=DEV, dtype=torch.bfloat16)
    ref = x.float() @ formats.int4.dequantize(q).to(DEV).T
    for use_asm in (True, False):
        y = mt.w4a16_matmul(
            x, w.codes, w.scales, w.global_scale, mt.FMT_INT4, w.group_size, config=cfg, use_asm=use_asm
        )
        assert _rel(y, ref) < 8e-3, (k, cfg, use_asm, _rel(y, ref))


def test_nvfp4_k_not_multiple_of_128_takes_the_reference_path():
    """64-wide K tiles give wrong nvfp4 results under Triton 3.6 (see matmul_triton._min_bk), so
    the kernel refuses them and qmatmul uses the reference for such K."""
    q, w = _weights("nvfp4", 256, 192, seed=3)
    x = torch.randn(5, 192, device=DEV, dtype=torch.bfloat16)
    assert RK._kernel_fmt(w, x) is None
    ref = x.float() @ formats.nvfp4.dequantize(q).to(DEV).T
    assert _rel(RK.qmatmul(x, w), ref) < 8e-3
    q, w = _weights("nvfp4", 256, 2048, seed=4)
    with pytest.raises(ValueError, match="K tile 64"):
        mt.w4a16_matmul(
            x.new_zeros(1, 2048), w.codes, w.scales, w.global_scale, mt.FMT_NVFP4, 0, config=(64, 64, 2, 2, 4)
        )


@pytest.mark.parametrize("fmt", ["nvfp4", "int4"])
def test_asm_and_plain_dequant_agree_bitwise(fmt):
    q, w = _weights(fmt, 512, 1024, seed=1)
    fid = mt.FMT_NVFP4 if fmt == "nvfp4" else mt.FMT_INT4
    x = torch.randn(16, 1024, device=DEV, dtype=torch.bfloat16)
    a = mt.w4a16_matmul(x, w.codes, w.scales, w.global_scale, fid, w.group_size, use_asm=True)
    b = mt.w4a16_matmul(x, w.codes, w.scales, w.global_scale, fid, w.group_size, use_asm=False)
    assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", ["nvfp4", "int4"])
def test_qmatmul_rows_do_not_depend_on_batch(fmt):
    q, w = _weights(fmt, 512, 1024, seed=2)
    x = torch.randn(37, 1024, device=DEV, dtype=torch.bfloat16)
    full = RK.qmatmul(x, w)
    for i in (0, 5, 36):
        assert torch.equal(RK.qmatmul(x[i : i + 1], w)[0], full[i])
    assert torch.equal(RK.qmatmul(x[3:20], w), full[3:20])


@pytest.mark.parametrize("fmt", ["nvfp4", "int4"])
def test_moe_qmatmul_matches_dense_kernel_and_reference(fmt):
    e, n, k, topk = 16, 256, 512, 4
    packed = []
    for i in range(e):
        packed.append(_weights(fmt, n, k, seed=100 + i)[1])
    stack = RK.pack_experts([RK.unpack(p) for p in packed])
    for t in (1, 5, 40):
        x = torch.randn(t, k, device=DEV, dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(e)[:topk] for _ in range(t)]).to(DEV)
        y = RK.moe_qmatmul(x, stack, ids)
        assert y.shape == (t, topk, n)
        # Bit-equal to the dense kernel run with the MoE launch's config (same K order; the
        # dense default splits K, so plain qmatmul may differ in the last bits).
        cfg = mt.pick_config(n, k, 0, 32, moe=True)
        fid = mt.FMT_NVFP4 if fmt == "nvfp4" else mt.FMT_INT4
        for ti in range(t):
            for j in range(topk):
                w = packed[int(ids[ti, j])]
                dense = mt.w4a16_matmul(
                    x[ti : ti + 1], w.codes, w.scales, w.global_scale, fid, w.group_size, config=cfg
                )[0]
                assert torch.equal(y[ti, j], dense), (fmt, t, ti, j)
        ref = torch.stack(
            [
                torch.stack(
                    [RK.reference_qmatmul(x[ti : ti + 1].float(), packed[int(ids[ti, j])])[0] for j in range(topk)]
                )
                for ti in range(t)
            ]
        )
        assert _rel(y, ref) < 8e-3


@pytest.mark.parametrize("fmt", ["nvfp4", "int4"])
def test_split_k_is_deterministic_and_matches_unsplit(fmt):
    q, w = _weights(fmt, 1024, 2048, seed=5)
    fid = mt.FMT_NVFP4 if fmt == "nvfp4" else mt.FMT_INT4
    x = torch.randn(20, 2048, device=DEV, dtype=torch.bfloat16)
    ref = x.float() @ formats.get(fmt).dequantize(q).to(DEV).T
    outs = {}
    for split in (1, 2, 4, 8):
        cfg = (32, 256, 2, 3, split)
        ys = [mt.w4a16_matmul(x, w.codes, w.scales, w.global_scale, fid, w.group_size, config=cfg) for _ in range(5)]
        assert all(torch.equal(ys[0], y) for y in ys[1:]), split  # same bits every launch
        assert _rel(ys[0], ref) < 8e-3, (split, _rel(ys[0], ref))
        outs[split] = ys[0]
    # A row's result does not depend on the batch, with split-K too.
    y1 = mt.w4a16_matmul(x[7:8], w.codes, w.scales, w.global_scale, fid, w.group_size, config=(32, 256, 2, 3, 4))
    assert torch.equal(y1[0], outs[4][7])


@pytest.mark.parametrize("fmt", ["nvfp4", "int4"])
@pytest.mark.parametrize("cfg", [(64, 128, 2, 2, 8), (64, 128, 2, 2, 8, 128), (64, 128, 2, 3, 8), (64, 256, 2, 2, 8)])
def test_two_mma_tiles_per_warp_configs(fmt, cfg):
    """Tiles with two 16-row MMA tiles per warp (the 8192x8192 entry, with its register cap):
    close to the reference, the same bits every launch and for every batch size (shapes
    divisible by 16 like the benchmark's, so its run reuses these compiled kernels)."""
    q, w = _weights(fmt, 1024, 2048, seed=6)
    fid = mt.FMT_NVFP4 if fmt == "nvfp4" else mt.FMT_INT4
    x = torch.randn(16, 2048, device=DEV, dtype=torch.bfloat16)  # M = 16 and 1: the tuning's sizes
    ref = x.float() @ formats.get(fmt).dequantize(q).to(DEV).T

    def run(xx):
        return mt.w4a16_matmul(xx, w.codes, w.scales, w.global_scale, fid, w.group_size, config=cfg)

    y = run(x)
    assert _rel(y, ref) < 8e-3, (cfg, _rel(y, ref))
    assert all(torch.equal(y, run(x)) for _ in range(3))
    assert torch.equal(run(x[7:8])[0], y[7]) and torch.equal(run(x[0:1])[0], y[0])


@pytest.mark.parametrize("fmt", ["nvfp4", "int4"])
@pytest.mark.parametrize("cfg", [(32, 256, 2, 3, 1), (64, 128, 4, 4, 1)])
def test_moe_persistent_launch_equals_one_program_per_tile(fmt, cfg):
    """The persistent MoE kernel (one program taking several (block, N tile) items, their K tiles
    as one loop) gives the bits of one program per item with the same tile, with and without
    per-token activation scales, whatever the number of programs."""
    e, n, k, topk = 16, 256, 512, 8
    stack = RK.pack_experts([K.to_device(_weights(fmt, n, k, seed=200 + i)[0], DEV) for i in range(e)])
    fid = mt.FMT_NVFP4 if fmt == "nvfp4" else mt.FMT_INT4
    for t in (1, 5, 40, 64):
        x = torch.randn(t, k, device=DEV, dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(e)[:topk] for _ in range(t)]).to(DEV)
        for xs in (None, torch.rand(t, device=DEV) + 0.5):
            args = (x, stack.codes, stack.scales, stack.global_scale, ids, fid, stack.group_size)
            ref = mt.moe_w4a16_matmul(*args, config=cfg, x_scale=xs)
            for per_sm in (1, 2, 5):
                got = mt.moe_w4a16_matmul(*args, config=(*cfg, 0, per_sm), x_scale=xs)
                assert torch.equal(got, ref), (fmt, cfg, t, per_sm, xs is None)
    with pytest.raises(ValueError, match="persistent MoE launch does not split K"):
        mt.moe_w4a16_matmul(*args, config=(*cfg[:4], 2, 0, 1))


def test_moe_align_kernel_matches_torch():
    for t, e, topk in [(1, 128, 8), (5, 128, 8), (64, 128, 8), (7, 16, 4), (40, 60, 6)]:
        ids = torch.stack([torch.randperm(e)[:topk] for _ in range(t)]).to(DEV)
        a = mt.moe_align(ids, e)
        b = mt.moe_align_fast(ids, e)
        assert a[3] == b[3] and torch.equal(a[2], b[2]), (t, e)
        nb = int(a[2])
        assert torch.equal(a[0][: nb * mt.BLOCK_M], b[0][: nb * mt.BLOCK_M]), (t, e)
        assert torch.equal(a[1][:nb], b[1][:nb]), (t, e)


def test_fp8_block_qmatmul_close_to_reference():
    n, k = 512, 1024
    w = torch.randn(n, k) * 0.02
    q = formats.fp8_block.quantize(w, block=(128, 128))
    qd = K.to_device(q, DEV)
    for m in (1, 16, 33):
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        y = RK.qmatmul(x, qd)
        ref = RK.reference_qmatmul(x, RK.pack(qd))
        assert _rel(y, ref) < 8e-3

"""policy/tp.py: the TP plan's styles, its refusals, and slicing packed tensors vs quantizing slices."""

from __future__ import annotations

import pytest
import torch

from policy import formats, tp
from policy.model import ModelConfig, parameter_shapes

PLAN = tp.TPPlan()
EXPERT_GATE_UP = "model.layers.1.mlp.experts.3.gate_up_proj.weight"
EXPERT_DOWN = "model.layers.1.mlp.experts.3.down_proj.weight"
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
O_PROJ = "model.layers.0.self_attn.o_proj.weight"


def _bytes(q) -> dict[str, bytes]:
    return {k: v.contiguous().view(torch.uint8).numpy().tobytes() for k, v in q.parts().items()}


def _weight(m: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Rows with very different ranges, so a slice's amax differs from the full tensor's.
    return torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m).unsqueeze(1)


def test_styles_of_every_canonical_parameter():
    cfg = ModelConfig.preset("tiny")
    styles = {name: PLAN.style(name) for name in parameter_shapes(cfg)}
    assert styles["model.layers.0.self_attn.q_proj.weight"] == tp.COLUMN
    assert styles["model.layers.0.self_attn.k_proj.weight"] == tp.COLUMN
    assert styles["model.layers.0.self_attn.v_proj.weight"] == tp.COLUMN
    assert styles[O_PROJ] == tp.ROW
    assert styles["model.layers.2.mlp.experts.7.gate_up_proj.weight"] == tp.COLUMN_GATE_UP
    assert styles["model.layers.2.mlp.shared_expert.gate_up_proj.weight"] == tp.COLUMN_GATE_UP
    assert styles["model.layers.2.mlp.experts.7.down_proj.weight"] == tp.ROW
    assert styles["model.layers.2.mlp.shared_expert.down_proj.weight"] == tp.ROW
    assert styles["lm_head.weight"] == tp.COLUMN
    for replicated in (
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_norm.weight",
    ):
        assert styles[replicated] == tp.REPLICATED, replicated


def test_plan_rejects_bad_rules_and_unmatched_names():
    with pytest.raises(ValueError, match="style 'diagonal'"):
        tp.TPPlan(rules=((".*", "diagonal"),))
    with pytest.raises(ValueError, match="invalid regular expression"):
        tp.TPPlan(rules=(("(", tp.ROW),))
    with pytest.raises(ValueError, match="no rule for tensor 'x.weight'"):
        tp.TPPlan(rules=(("lm_head\\.weight", tp.COLUMN),)).style("x.weight")


@pytest.mark.parametrize(
    ("name", "fmt", "kwargs", "shape", "tp_size", "fragment"),
    [
        (EXPERT_DOWN, "nvfp4", {"scope": "tensor"}, (64, 48), 2, "24 columns of K, not a whole number of 16-column"),
        (EXPERT_DOWN, "mxfp8", {}, (64, 64), 4, "16 columns of K, not a whole number of 32-column"),
        (EXPERT_DOWN, "int4", {"group_size": 32}, (64, 96), 2, "48 columns of K, not a whole number of 32-column"),
        (
            O_PROJ,
            "fp8_block",
            {"block": (128, 128)},
            (128, 128),
            2,
            "64 columns of K, not a whole number of 128-column",
        ),
        (
            EXPERT_GATE_UP,
            "fp8_block",
            {"block": (128, 128)},
            (256, 128),
            2,
            "64 rows per half, not a whole number of 128-row",
        ),
        (Q_PROJ, "fp8_block", {"block": (128, 128)}, (384, 128), 2, "192 rows, not a whole number of 128-row"),
        (Q_PROJ, "bf16", {}, (30, 64), 4, "M=30 rows do not divide by tp_size=4"),
        (EXPERT_GATE_UP, "nvfp4", {}, (6, 64), 2, "gate and up halves of 3 rows do not divide by tp_size=2"),
        (EXPERT_DOWN, "nvfp4", {}, (64, 80), 3, "K=80 does not divide by tp_size=3"),
    ],
)
def test_refuses_shards_off_block_boundaries(name, fmt, kwargs, shape, tp_size, fragment):
    with pytest.raises(ValueError) as e:
        PLAN.check({name: (fmt, kwargs, shape)}, tp_size)
    msg = str(e.value)
    assert fragment in msg
    assert name in msg and f"tp_size={tp_size}" in msg  # names tensor and tp_size
    with pytest.raises(ValueError):
        PLAN.cut(name, fmt=fmt, kwargs=kwargs, shape=shape, tp_rank=0, tp_size=tp_size)


def test_refusal_names_every_offending_tensor_and_whole_heads():
    tensors = {
        EXPERT_DOWN: ("nvfp4", {}, (64, 48)),
        O_PROJ: ("mxfp8", {}, (64, 96)),
        "model.norm.weight": ("bf16", {}, (1, 64)),
    }
    with pytest.raises(ValueError) as e:
        PLAN.check(tensors, 2)
    assert EXPERT_DOWN in str(e.value) and O_PROJ in str(e.value) and "model.norm.weight" not in str(e.value)
    with pytest.raises(ValueError, match="not whole heads of head_dim=32"):
        PLAN.check({Q_PROJ: ("bf16", {}, (64, 64))}, 4, head_dim=32)
    PLAN.check({Q_PROJ: ("bf16", {}, (64, 64))}, 2, head_dim=32)  # 32 rows = one head: fine
    with pytest.raises(ValueError, match="tp_rank=2 must be an int in"):
        PLAN.cut(Q_PROJ, fmt="bf16", kwargs={}, shape=(64, 64), tp_rank=2, tp_size=2)


CASES = [
    # (name, fmt, kwargs, shape)
    (Q_PROJ, "mxfp8", {}, (64, 128)),
    (O_PROJ, "mxfp8", {}, (64, 128)),
    (EXPERT_GATE_UP, "int4", {"group_size": 32}, (64, 128)),
    (EXPERT_DOWN, "int4", {"group_size": 32}, (32, 256)),
    (Q_PROJ, "bf16", {}, (64, 64)),
    (EXPERT_DOWN, "bf16", {}, (16, 64)),
    (EXPERT_GATE_UP, "fp8_block", {"block": (128, 128)}, (1024, 128)),
    (EXPERT_DOWN, "fp8_block", {"block": (128, 128)}, (128, 512)),
    (EXPERT_DOWN, "fp8_block", {"block": (1, 128)}, (8, 512)),
]


@pytest.mark.parametrize(("name", "fmt", "kwargs", "shape"), CASES)
@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_slice_of_packed_equals_quantized_slice_for_block_local_formats(name, fmt, kwargs, shape, tp_size):
    mod = formats.get(fmt)
    kw = tp.from_parts_kwargs(fmt, kwargs)
    w = _weight(*shape)
    full = mod.quantize(w, **kw)
    for rank in range(tp_size):
        cut = PLAN.cut(name, fmt=fmt, kwargs=kwargs, shape=shape, tp_rank=rank, tp_size=tp_size)
        rows = torch.cat([w[a:b] for a, b in cut.rows])
        w_slice = rows[:, cut.cols[0] : cut.cols[1]]
        shard = tp.shard_quantized(full, fmt=fmt, kwargs=kwargs, cut=cut)
        assert shard.shape == cut.shape == tuple(w_slice.shape)
        assert _bytes(shard) == _bytes(mod.quantize(w_slice, **kw)), (fmt, tp_size, rank)


@pytest.mark.parametrize(
    ("name", "shape"), [(EXPERT_GATE_UP, (64, 128)), (EXPERT_DOWN, (32, 256)), ("lm_head.weight", (64, 64))]
)
def test_nvfp4_slice_keeps_the_full_tensors_global_scale(name, shape):
    """nvfp4 tensor scope: the slice carries the full tensor's global scale; it equals quantizing the
    slice only when the slice's amax is the tensor's amax, and differs otherwise (why the canonical
    bytes are "quantize the full tensor, then slice")."""
    w = _weight(*shape, seed=1)
    full = formats.nvfp4.quantize(w, scope="tensor")
    differs = 0
    for rank in range(4):
        cut = PLAN.cut(name, fmt="nvfp4", kwargs={"scope": "tensor"}, shape=shape, tp_rank=rank, tp_size=4)
        shard = tp.shard_quantized(full, fmt="nvfp4", kwargs={"scope": "tensor"}, cut=cut)
        assert torch.equal(shard.global_scale, full.global_scale)
        rows = torch.cat([w[a:b] for a, b in cut.rows])
        w_slice = rows[:, cut.cols[0] : cut.cols[1]]
        alone = formats.nvfp4.quantize(w_slice, scope="tensor")
        same_amax = w_slice.abs().max() == w.abs().max()
        assert (_bytes(alone) == _bytes(shard)) == bool(same_amax)
        differs += not same_amax
        # Dequantized with the shared scale, the shard is exactly the slice of the full dequantization.
        full_dq = formats.nvfp4.dequantize(full)
        ref = torch.cat([full_dq[a:b] for a, b in cut.rows])[:, cut.cols[0] : cut.cols[1]]
        assert torch.equal(formats.nvfp4.dequantize(shard), ref)
    assert differs >= 2


def test_gate_up_shard_is_gate_slice_then_up_slice():
    f, k, tps = 32, 64, 4
    w = _weight(2 * f, k)
    q = formats.mxfp8.quantize(w)
    for rank in range(tps):
        cut = PLAN.cut(EXPERT_GATE_UP, fmt="mxfp8", kwargs={}, shape=(2 * f, k), tp_rank=rank, tp_size=tps)
        h = f // tps
        assert cut.rows == ((rank * h, (rank + 1) * h), (f + rank * h, f + (rank + 1) * h))
        shard = tp.shard_quantized(q, fmt="mxfp8", kwargs={}, cut=cut)
        assert torch.equal(shard.codes[:h].view(torch.uint8), q.codes[rank * h : (rank + 1) * h].view(torch.uint8))
        assert torch.equal(
            shard.codes[h:].view(torch.uint8), q.codes[f + rank * h : f + (rank + 1) * h].view(torch.uint8)
        )


def test_nvfp4_row_scope_parts_slice_per_row():
    w = _weight(16, 64)
    q = formats.nvfp4.quantize(w, scope="row")
    cut = PLAN.cut(Q_PROJ, fmt="nvfp4", kwargs={"scope": "row"}, shape=(16, 64), tp_rank=1, tp_size=2)
    shard = tp.shard_quantized(q, fmt="nvfp4", kwargs={"scope": "row"}, cut=cut)
    assert _bytes(shard) == _bytes(formats.nvfp4.quantize(w[8:], scope="row"))  # rows are independent


def test_activation_without_group_is_plain_quantization_and_shard_mismatch_is_refused():
    x = _weight(8, 64)
    q = tp.quantize_activation(x, fmt="nvfp4", scope="row", tp_scale_mode="global")
    assert _bytes(q) == _bytes(formats.nvfp4.quantize(x, scope="row"))
    q = tp.quantize_activation(x, fmt="mxfp8", tp_scale_mode="shard", partition_tp_size=1)
    assert _bytes(q) == _bytes(formats.mxfp8.quantize(x))
    with pytest.raises(ValueError, match="pins the trainer's partition tp_size=2; this TP group has tp_size=1"):
        tp.quantize_activation(x, fmt="nvfp4", scope="row", tp_scale_mode="shard", partition_tp_size=2)
    with pytest.raises(ValueError, match="tp_scale_mode 'sharded' is not one of"):
        tp.quantize_activation(x, fmt="nvfp4", tp_scale_mode="sharded")
    y = tp.fake_quant_activation(x.to(torch.bfloat16), fmt="nvfp4", scope="row")
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, formats.nvfp4.fake_quant(x.to(torch.bfloat16), scope="row"))


def test_block_shapes_follow_the_formats():
    assert tp.block_shape("nvfp4") == (1, formats.nvfp4.BLOCK)
    assert tp.block_shape("mxfp8") == (1, formats.mxfp8.BLOCK)
    assert tp.block_shape("int4", {"group_size": 64}) == (1, 64)
    assert tp.block_shape("fp8_block", {"block": [1, 128]}) == (1, 128)
    assert tp.block_shape("fp8_block") == formats.fp8_block.WEIGHT_BLOCK
    with pytest.raises(ValueError, match="unknown quantization format 'fp6'"):
        tp.block_shape("fp6")

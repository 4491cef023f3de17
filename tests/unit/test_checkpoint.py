"""policy.checkpoint against transformers itself: small random Qwen3 / Qwen3-MoE models built with
transformers, saved with save_pretrained, loaded by load_hf -> Tandem's logits equal transformers'
(fp32, relative error <= 1e-5); save_hf -> from_pretrained -> the same logits; refusals name the field."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from policy.checkpoint import load_hf, read_config, read_shapes, save_hf
from policy.model import ModelConfig, Transformer
from policy.recipe import Recipe

transformers = pytest.importorskip("transformers")

MOE_SHAPES = [
    # GQA 4:2, norm_topk_prob on, one dense layer (mlp_only_layers)
    dict(
        hidden_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=20,
        intermediate_size=40,
        num_hidden_layers=3,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
    # MHA, norm_topk_prob off, decoder_sparse_step 2 (layers 1 and 3 sparse), odd sizes
    dict(
        hidden_size=40,
        num_attention_heads=5,
        num_key_value_heads=5,
        head_dim=8,
        num_experts=3,
        num_experts_per_tok=1,
        moe_intermediate_size=13,
        intermediate_size=27,
        num_hidden_layers=4,
        norm_topk_prob=False,
        decoder_sparse_step=2,
    ),
    # GQA 6:1 (MQA), head_dim != hidden/heads, tied embeddings
    dict(
        hidden_size=36,
        num_attention_heads=6,
        num_key_value_heads=1,
        head_dim=10,
        num_experts=5,
        num_experts_per_tok=3,
        moe_intermediate_size=17,
        intermediate_size=20,
        num_hidden_layers=2,
        norm_topk_prob=True,
        tie_word_embeddings=True,
    ),
]
DENSE_SHAPES = [
    dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=12, intermediate_size=40,
         num_hidden_layers=2, tie_word_embeddings=True),
    dict(hidden_size=30, num_attention_heads=3, num_key_value_heads=3, head_dim=14, intermediate_size=33,
         num_hidden_layers=3, tie_word_embeddings=False),
]  # fmt: skip


def _hf_model(kind: str, shape: dict, seed: int = 0):
    torch.manual_seed(seed)
    common = dict(vocab_size=67, rope_theta=5000.0, rms_norm_eps=1e-6, max_position_embeddings=256)
    if kind == "moe":
        # eager experts: torch._grouped_mm on CPU needs 16-byte strides, which odd sizes lack
        config = transformers.Qwen3MoeConfig(**common, **shape, experts_implementation="eager")
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.Qwen3Config(**common, **shape)
        model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():  # every parameter random (norm weights too), so a wrong mapping shows
        for p in model.parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if p.ndim == 1 else 0.2 * torch.randn_like(p))
    return model.float().eval()


def _tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 67, (2, 11), generator=torch.Generator().manual_seed(seed))


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _tandem_logits(cfg: ModelConfig, tensors: dict, tokens: torch.Tensor) -> torch.Tensor:
    model = Transformer(cfg, seed=None)
    model.load_weights({n: t.float() for n, t in tensors.items()})
    with torch.no_grad():
        return model(tokens).float()


CASES = [("moe", s) for s in MOE_SHAPES] + [("dense", s) for s in DENSE_SHAPES]


@pytest.mark.parametrize("kind,shape", CASES, ids=[f"{k}{i}" for i, (k, _) in enumerate(CASES)])
def test_load_hf_logits_match_transformers(tmp_path, kind, shape):
    hf = _hf_model(kind, shape)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="30KB")  # several shards: the index path
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    cfg, tensors = load_hf(tmp_path / "hf")
    assert cfg.tie_word_embeddings == bool(shape.get("tie_word_embeddings", False))
    assert cfg.n_experts == shape.get("num_experts", 0)
    tokens = _tokens()
    with torch.no_grad():
        ref = hf(tokens).logits.float()
    assert _rel_err(_tandem_logits(cfg, tensors, tokens), ref) <= 1e-5


@pytest.mark.parametrize("kind,shape", CASES, ids=[f"{k}{i}" for i, (k, _) in enumerate(CASES)])
def test_save_hf_loads_in_transformers_with_same_logits(tmp_path, kind, shape):
    hf = _hf_model(kind, shape, seed=3)
    hf.save_pretrained(tmp_path / "hf")
    cfg, tensors = load_hf(tmp_path / "hf")
    save_hf(tmp_path / "out", cfg, tensors, dtype=torch.float32, max_shard_bytes=20_000)
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()  # written shard by shard
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", dtype=torch.float32, experts_implementation="eager"
    ).eval()
    tokens = _tokens(2)
    with torch.no_grad():
        got, ref = back(tokens).logits.float(), hf(tokens).logits.float()
    assert _rel_err(got, ref) <= 1e-5
    assert _rel_err(_tandem_logits(cfg, tensors, tokens), got) <= 1e-5
    # and round trip through Tandem again: same config, bit-identical tensors
    cfg2, tensors2 = load_hf(tmp_path / "out")
    assert cfg2 == cfg and all(torch.equal(tensors2[n], tensors[n]) for n in tensors)


def test_save_hf_streams_from_a_generator_in_bf16(tmp_path):
    cfg = ModelConfig.preset("tiny-dense", n_layers=2, vocab_size=64, dim=64, ffn_dim=96, head_dim=16)
    model = Transformer(cfg, seed=5)
    save_hf(tmp_path / "m", cfg, ((n, p.detach()) for n, p in model.named_parameters()), max_shard_bytes=50_000)
    cfg2, tensors = load_hf(tmp_path / "m")
    assert cfg2 == cfg
    assert all(tensors[n].dtype == torch.bfloat16 for n in tensors)
    assert all(torch.equal(tensors[n], p.detach().bfloat16()) for n, p in model.named_parameters())
    assert len(json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())["weight_map"]) > 0


def test_read_shapes_and_plan_without_weights(tmp_path):
    hf = _hf_model("moe", MOE_SHAPES[0])
    hf.save_pretrained(tmp_path / "hf")
    cfg, shapes = read_shapes(tmp_path / "hf")
    assert shapes["model.layers.0.mlp.experts.1.gate_up_proj.weight"] == (40, 48)
    assert shapes["model.layers.1.mlp.gate_up_proj.weight"] == (80, 48)  # the dense layer
    with torch.device("meta"):
        meta = Transformer(cfg)
    assert {n: tuple(p.shape) for n, p in meta.named_parameters()} == shapes


def test_recipes_on_dense_layers():
    cfg = ModelConfig.preset("tiny-dense")
    for name, fmt in (("int4_qat", "int4"), ("mxfp8", "mxfp8"), ("fp8_block", "fp8_block")):
        plan = Recipe.load(name).plan(cfg)
        assert plan["model.layers.0.mlp.gate_up_proj.weight"].format == fmt
        assert plan["model.layers.0.mlp.down_proj.weight"].format == fmt
    with pytest.warns(UserWarning, match="matches no parameter"):
        plan = Recipe.load("nvfp4_moe").plan(cfg)
    assert set(plan.numel_by_format()) == {"bf16"}  # only routed experts: a dense model is all bf16
    mixed = ModelConfig.preset("tiny", mlp_only_layers=(0,), ffn_dim=256)
    plan = Recipe.load("nvfp4_moe").plan(mixed)
    assert plan["model.layers.0.mlp.gate_up_proj.weight"].format == "bf16"
    assert plan["model.layers.1.mlp.experts.0.gate_up_proj.weight"].format == "nvfp4"


def _write_config(tmp_path, hf_model, **changes):
    hf_model.save_pretrained(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    d.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(d))


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"model_type": "llama"}, "model_type"),
        ({"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "rope_parameters"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        ({"some_new_feature": 1}, "some_new_feature"),
    ],
)
def test_refusals_name_the_field(tmp_path, changes, field):
    _write_config(tmp_path, _hf_model("dense", DENSE_SHAPES[0]), **changes)
    with pytest.raises(ValueError, match=field):
        read_config(tmp_path)


def test_refuses_bias_tensors_and_missing_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    _write_config(tmp_path, _hf_model("dense", DENSE_SHAPES[1]))
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({**tensors, "model.layers.0.self_attn.q_proj.bias": torch.zeros(42)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="biases"):
        load_hf(tmp_path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\]"):
        load_hf(tmp_path)


def test_save_hf_refuses_a_shared_expert(tmp_path):
    cfg = ModelConfig.preset("tiny")
    with pytest.raises(ValueError, match="shared_expert_ffn_dim"):
        save_hf(tmp_path, cfg, {})


@pytest.mark.parametrize("recipe", ["int4_qat", "mxfp8", pytest.param("fp8_block", marks=pytest.mark.slow)])
def test_qat_and_packed_weights_agree_on_a_tied_dense_model(recipe):
    from policy.qat import probe_mismatch

    cfg = ModelConfig.preset("tiny-dense", n_layers=2)
    model = Transformer(cfg, seed=2)
    out = probe_mismatch(model, Recipe.load(recipe), _tokens(4) % cfg.vocab_size)
    assert out["weights_bitwise_equal"]
    assert out["pairs"]["bf16~qat"]["mean_abs_dlogp"] > 0  # the dense MLPs really are quantized


def test_model_checkpoint_in_the_run_config(tmp_path):
    from tandem.config import ModelSection
    from tandem.services import model_config_for

    _hf_model("dense", DENSE_SHAPES[0]).save_pretrained(tmp_path)
    cfg = model_config_for(ModelSection(checkpoint=str(tmp_path)), vocab_size=50)
    assert cfg == read_config(tmp_path) and cfg.vocab_size == 67  # the checkpoint's vocab, not the tokenizer's
    assert model_config_for(ModelSection(checkpoint=str(tmp_path), overrides={"max_seq_len": 64}), 50).max_seq_len == 64
    with pytest.raises(ValueError, match=r"model.overrides \['dim'\]: .* \(dim=48; only max_seq_len may differ"):
        model_config_for(ModelSection(checkpoint=str(tmp_path), overrides={"dim": 64}), 50)
    agreeing = ModelSection(checkpoint=str(tmp_path), overrides={"dim": 48, "shared_expert_ffn_dim": 0})
    assert model_config_for(agreeing, 50) == cfg  # an override that says what config.json says is no conflict
    with pytest.raises(ValueError, match="disagrees with model.checkpoint: dim: preset 128, checkpoint 48"):
        model_config_for(ModelSection(checkpoint=str(tmp_path), preset="tiny-dense"), 50)
    # a run takes neither vocab_size nor max_seq_len from a preset: the demo's export agrees with preset demo
    demo = ModelConfig.preset("demo", vocab_size=15, max_seq_len=64)
    save_hf(tmp_path / "demo", demo, Transformer(demo).named_parameters())
    assert model_config_for(ModelSection(checkpoint=str(tmp_path / "demo"), preset="demo"), 15) == demo
    assert model_config_for(ModelSection(preset="tiny"), 15) == ModelConfig.preset(
        "tiny", vocab_size=15, max_seq_len=64
    )
    with pytest.raises(ValueError, match="more than the checkpoint's vocab_size 67"):
        model_config_for(ModelSection(checkpoint=str(tmp_path)), vocab_size=100)


def test_load_hf_into_a_model_whose_max_seq_len_was_overridden(tmp_path):
    # model.overrides may set max_seq_len with model.checkpoint (services.model_config_for): the
    # trainer's Transformer then differs from config.json in that field alone, and loads the weights.
    from policy.checkpoint import load_hf_into

    cfg = ModelConfig.preset("tiny", shared_expert_ffn_dim=0, n_layers=1)
    source = Transformer(cfg, seed=3)
    save_hf(tmp_path, cfg, source.named_parameters(), dtype=torch.float32)
    target = Transformer(dataclasses.replace(cfg, max_seq_len=64), seed=4)
    load_hf_into(target, tmp_path)
    for (name, a), (_, b) in zip(source.named_parameters(), target.named_parameters()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="does not describe this model .*dim: 128 vs 64"):
        load_hf_into(Transformer(dataclasses.replace(cfg, dim=64), seed=4), tmp_path)

"""policy.recipe: built-in recipes, plans checked by hand, validation errors and warnings, `tandem plan`."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import yaml

from policy.model import ModelConfig, Transformer
from policy.recipe import BUILTINS, RECIPE_DIR, Recipe, Rule
from tandem import cli

TINY = ModelConfig.preset("tiny")
Q30 = ModelConfig.preset("qwen3-30b-a3b")

# Hand counts. tiny: D=128, 4 layers, 8 experts with F=256, shared F=256, Hq*hd=128, Hkv*hd=64, V=512.
TINY_EXPERTS_PER_LAYER = 8 * (2 * 256 * 128 + 128 * 256)  # 786,432
TINY_TOTAL = 3_872_128
# qwen3-30b-a3b: D=2048, 48 layers, 128 experts with F=768.
Q30_EXPERTS_PER_LAYER = 128 * (2 * 768 * 2048 + 2048 * 768)  # 603,979,776
Q30_TOTAL = 30_532_122_624


def _plan(recipe, cfg):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # built-ins must plan without warnings
        return Recipe.load(recipe).plan(cfg)


def test_builtins_load_and_roundtrip():
    assert set(BUILTINS) == {p.stem for p in RECIPE_DIR.glob("*.yaml")}
    for name in BUILTINS:
        r = Recipe.load(name)
        assert r.name == name
        assert Recipe.from_dict(r.to_dict()) == r
        assert Recipe.from_dict(yaml.safe_load(r.to_yaml())).fingerprint() == r.fingerprint()
        assert Recipe.load(RECIPE_DIR / f"{name}.yaml") == r
    fps = {Recipe.load(n).fingerprint() for n in BUILTINS}
    assert len(fps) == len(BUILTINS)
    with pytest.raises(ValueError, match="unknown recipe 'nvfp5'"):
        Recipe.load("nvfp5")


def test_nvfp4_moe_tiny_by_hand():
    plan = _plan("nvfp4_moe", TINY)
    assert plan.bf16_layers == (3,)  # ceil(0.15 * 4) = 1: the last layer
    assert plan.numel_by_format() == {
        "nvfp4": 3 * TINY_EXPERTS_PER_LAYER,
        "bf16": TINY_TOTAL - 3 * TINY_EXPERTS_PER_LAYER,
    }
    assert plan.count_by_format("param") == {"nvfp4/tensor": 3 * 8 * 2, "bf16": 1 + 4 * 9 + 4 * 16 - 48 + 4 * 2 + 2}
    assert plan.count_by_format("activation") == {"nvfp4/row": 3 * 8 * 2, "bf16": 4 * 23 + 1 - 48}
    e = plan["model.layers.0.mlp.experts.3.gate_up_proj.weight"]
    assert (e.format, e.scope, e.kwargs, e.shape, e.numel) == (
        "nvfp4",
        "tensor",
        {"scope": "tensor"},
        (512, 128),
        65536,
    )
    a = plan["model.layers.2.mlp.experts.7.down_proj.input"]
    assert (a.format, a.scope, a.kwargs, a.shape) == ("nvfp4", "row", {"scope": "row"}, (-1, 256))
    for name in ("model.layers.3.mlp.experts.0.gate_up_proj.weight", "model.layers.3.mlp.experts.0.down_proj.input"):
        assert plan[name].format == "bf16" and plan[name].rule == "keep_bf16"
    for name in (
        "model.layers.0.mlp.shared_expert.gate_up_proj.weight",
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.mlp.shared_expert.down_proj.input",
        "model.layers.0.self_attn.o_proj.input",
        "lm_head.input",
    ):
        assert plan[name].format == "bf16" and plan[name].rule is None


def test_nvfp4_moe_qwen3_30b_by_hand():
    plan = _plan("nvfp4_moe", Q30)
    assert plan.bf16_layers == tuple(range(40, 48))  # ceil(0.15 * 48) = ceil(7.2) = 8
    nvfp4 = 40 * Q30_EXPERTS_PER_LAYER
    assert nvfp4 == 24_159_191_040
    assert plan.numel_by_format() == {"nvfp4": nvfp4, "bf16": Q30_TOTAL - nvfp4}
    assert plan.count_by_format("param")["nvfp4/tensor"] == 40 * 128 * 2
    assert plan.count_by_format("activation")["nvfp4/row"] == 40 * 128 * 2
    for i in (39, 40):
        want = "nvfp4" if i < 40 else "bf16"
        assert plan[f"model.layers.{i}.mlp.experts.127.down_proj.weight"].format == want
        assert plan[f"model.layers.{i}.mlp.experts.0.gate_up_proj.input"].format == want
    assert plan["model.layers.0.mlp.experts.0.gate_up_proj.weight"].shape == (1536, 2048)
    assert set(plan.activation_scopes().values()) == {"row"}


def test_mxfp8_and_fp8_block_quantize_every_linear_but_router_embeddings_head():
    # bf16: embeddings + head 2*512*128, per layer router 8*128 + norms 2*128 + q/k norms 2*32, final norm.
    bf16 = 2 * 512 * 128 + 4 * (8 * 128 + 2 * 128 + 2 * 32) + 128
    for name, kw_w, kw_a in (("mxfp8", {}, {}), ("fp8_block", {"block": (128, 128)}, {"block": (1, 128)})):
        plan = _plan(name, TINY)
        assert plan.bf16_layers == ()
        assert plan.numel_by_format() == {name: TINY_TOTAL - bf16, "bf16": bf16}
        for site in (
            "self_attn.q_proj",
            "self_attn.o_proj",
            "mlp.experts.5.down_proj",
            "mlp.shared_expert.gate_up_proj",
        ):
            w, a = plan[f"model.layers.3.{site}.weight"], plan[f"model.layers.3.{site}.input"]
            assert (w.format, w.kwargs, a.format, a.kwargs) == (name, kw_w, name, kw_a)
        for n in (
            "model.layers.0.mlp.gate.weight",
            "model.layers.0.mlp.gate.input",
            "lm_head.weight",
            "lm_head.input",
            "model.embed_tokens.weight",
            "model.norm.weight",
        ):
            assert plan[n].format == "bf16"
    q = _plan("fp8_block", Q30)
    assert q.numel_by_format()["bf16"] == 2 * 151936 * 2048 + 48 * (128 * 2048 + 2 * 2048 + 2 * 128) + 2048


def test_int4_qat_is_w4a16():
    plan = _plan("int4_qat", TINY)
    assert plan.numel_by_format() == {
        "int4": 4 * TINY_EXPERTS_PER_LAYER,
        "bf16": TINY_TOTAL - 4 * TINY_EXPERTS_PER_LAYER,
    }
    e = plan["model.layers.3.mlp.experts.0.down_proj.weight"]
    assert (e.format, e.scope, e.kwargs) == ("int4", "group", {"group_size": 32})
    assert {a.format for a in plan.activations} == {"bf16"}
    assert plan["model.layers.0.mlp.shared_expert.down_proj.weight"].format == "bf16"


def test_plan_from_meta_model_equals_plan_from_config():
    cfg = ModelConfig.preset("qwen3-30b-a3b", n_layers=3)
    with torch.device("meta"):
        m = Transformer(cfg)
    r = Recipe.load("nvfp4_moe")
    assert r.plan(m).params == r.plan(cfg).params
    assert r.plan(m).activations == r.plan(cfg).activations


def test_keep_bf16_fraction_is_exact_and_first_n():
    r = Recipe(name="t", keep_bf16_last_fraction=0.15)
    assert r.bf16_layers(20) == (17, 18, 19)  # 0.15 * 20 is 3.0000000000000004 in floats
    assert r.bf16_layers(48) == tuple(range(40, 48))
    assert Recipe(name="t", keep_bf16_last_fraction=0.15, keep_bf16_first=2).bf16_layers(4) == (0, 1, 3)
    assert Recipe(name="t", keep_bf16_last_fraction=1.0).bf16_layers(3) == (0, 1, 2)
    assert Recipe(name="t").bf16_layers(5) == ()
    d = Recipe.load("nvfp4_moe").to_dict()
    d["keep_bf16"] = {"last_fraction": 0.0, "first": 1}
    plan = Recipe.from_dict(d).plan(TINY)
    assert plan.bf16_layers == (0,)
    assert plan["model.layers.0.mlp.experts.0.down_proj.weight"].format == "bf16"
    assert plan["model.layers.3.mlp.experts.0.down_proj.weight"].format == "nvfp4"


def test_layer_selector_and_first_match_wins():
    r = Recipe.from_dict(
        {
            "name": "t",
            "rules": [
                {"match": "model.layers.*.mlp.experts.0.*.weight", "format": "mxfp8", "layers": "-1:"},
                {"match": "model.layers.*.mlp.experts.*.*.weight", "format": "int4", "layers": [0, 2]},
                {"match": "**.weight", "format": "bf16"},
            ],
        }
    )
    plan = r.plan(TINY)
    assert plan["model.layers.3.mlp.experts.0.down_proj.weight"].format == "mxfp8"
    assert plan["model.layers.3.mlp.experts.1.down_proj.weight"].rule == 2
    assert plan["model.layers.2.mlp.experts.0.down_proj.weight"].format == "int4"
    assert plan["model.layers.1.mlp.experts.4.gate_up_proj.weight"].format == "bf16"
    assert plan["lm_head.weight"].rule == 2


def test_single_star_stays_in_one_component():
    r = Recipe.from_dict({"name": "t", "rules": [{"match": "model.layers.*.down_proj.weight", "format": "mxfp8"}]})
    with pytest.warns(UserWarning, match="matches no parameter"):
        plan = r.plan(TINY)
    assert set(plan.numel_by_format()) == {"bf16"}
    assert plan.warnings and "rule 0" in plan.warnings[0]


@pytest.mark.parametrize(
    "rule, message",
    [
        ({"match": "**.weight", "format": "nvfp5"}, "unknown format 'nvfp5'"),
        ({"match": "**.weight", "format": "int4", "scope": "row"}, "scope='row' is only valid for nvfp4"),
        ({"match": "**.weight", "format": "nvfp4", "scope": "block"}, "scope='block'"),
        ({"match": "**.weight", "format": "mxfp8", "group_size": 32}, "group_size=32 is only valid for int4"),
        ({"match": "**.weight", "format": "fp8_block", "block": [128]}, "block="),
        ({"match": "**.weight", "format": "int4", "layers": "a:b"}, "layers 'a:b'"),
        ({"match": "**.weight", "format": "int4", "color": "red"}, "unknown key"),
        ({"format": "int4"}, "missing key"),
    ],
)
def test_bad_rules_are_rejected(rule, message):
    with pytest.raises(ValueError, match="rules\\[0\\]") as e:
        Recipe.from_dict({"name": "bad", "rules": [rule]})
    assert message in str(e.value)


@pytest.mark.parametrize(
    "rule, message",
    [
        # tiny: expert gate_up K=128, down K=256. 96 divides neither.
        (
            {"match": "model.layers.*.mlp.experts.*.*.weight", "format": "int4", "group_size": 96},
            "K=128 is not a multiple of the int4 block size 96",
        ),
        (
            {"match": "model.layers.*.mlp.experts.*.*.weight", "format": "fp8_block", "block": [128, 100]},
            "not a multiple of the fp8_block block size 100",
        ),
        (
            {"match": "model.layers.*.mlp.experts.*.*.input", "format": "nvfp4", "scope": "tensor"},
            "nvfp4 activations need scope 'row'",
        ),
        ({"match": "model.layers.*.mlp.experts.*.*.input", "format": "int4"}, "weight-only"),
        (
            {"match": "model.layers.*.mlp.experts.*.*.input", "format": "fp8_block", "block": [128, 128]},
            "must be one row",
        ),
        ({"match": "model.norm.weight", "format": "mxfp8"}, "1-D parameter"),
    ],
)
def test_recipes_that_do_not_fit_the_model_are_rejected(rule, message):
    r = Recipe.from_dict({"name": "bad", "rules": [rule]})
    with pytest.raises(ValueError, match="does not fit the model") as e:
        r.plan(TINY)
    assert message in str(e.value)


def test_bad_recipe_fields_and_files(tmp_path):
    with pytest.raises(ValueError, match="last_fraction=1.5"):
        Recipe(name="x", keep_bf16_last_fraction=1.5)
    with pytest.raises(ValueError, match="unknown key"):
        Recipe.from_dict({"name": "x", "rulez": []})
    p = tmp_path / "r.yaml"
    p.write_text("name: x\nrules:\n  - match: '**.weight'\n    format: fp4\n")
    with pytest.raises(ValueError, match=r"r\.yaml.*unknown format 'fp4'"):
        Recipe.load(p)
    p.write_text("name: [unclosed\n")
    with pytest.raises(ValueError, match=r"recipe file '.*r\.yaml': YAML syntax error \(line 2, column 1\)"):
        Recipe.load(p)


def test_shadowed_rule_warns():
    r = Recipe.from_dict(
        {
            "name": "t",
            "rules": [{"match": "**.weight", "format": "bf16"}, {"match": "lm_head.weight", "format": "mxfp8"}],
        }
    )
    with pytest.warns(UserWarning, match="rule 1 .* never applies"):
        r.plan(TINY)


def test_fingerprint_ignores_description_only():
    r = Recipe.load("nvfp4_moe")
    d = r.to_dict()
    d["description"] = "other words"
    assert Recipe.from_dict(d).fingerprint() == r.fingerprint()
    d["keep_bf16"]["last_fraction"] = 0.2
    assert Recipe.from_dict(d).fingerprint() != r.fingerprint()
    assert isinstance(Recipe.load("nvfp4_moe").rules[0], Rule)


def test_cli_plan_json(capsys):
    assert cli.main(["plan", "nvfp4_moe", "--model", "tiny", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    params = out["parameters"]
    assert len(params) == len(dict(Transformer(TINY).named_parameters()))
    assert all({"name", "format", "scope", "numel"} <= set(p) for p in params)
    by = {p["name"]: p for p in params}
    assert by["model.layers.1.mlp.experts.2.down_proj.weight"]["format"] == "nvfp4"
    assert by["model.layers.3.mlp.experts.2.down_proj.weight"]["format"] == "bf16"
    assert sum(p["numel"] for p in params if p["format"] == "nvfp4") == 3 * TINY_EXPERTS_PER_LAYER
    assert out["bf16_layers"] == [3]


def test_cli_plan_text_30b(capsys):
    assert cli.main(["plan", "nvfp4_moe", "--model", "qwen3-30b-a3b"]) == 0
    out = capsys.readouterr().out
    assert "layers kept whole in bf16: 40-47" in out
    assert "24,159,191,040" in out
    assert cli.main(["plan", "nope", "--model", "tiny"]) == 2
    assert "unknown recipe 'nope'" in capsys.readouterr().err

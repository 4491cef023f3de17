"""Run configuration: YAML + key=value overrides, validation that names the offending keys."""

from __future__ import annotations

import pytest

from rollout.tasks import AdditionTask, CharTokenizer
from tandem import config


def test_demo_config_loads_and_overrides_apply():
    cfg = config.load("demo.yaml", ["trainer.max_steps=3", "max_staleness=0", "model.overrides={n_layers: 2}"])
    assert cfg.trainer.max_steps == 3 and cfg.max_staleness == 0 and cfg.model.overrides == {"n_layers": 2}
    assert cfg.recipe == "nvfp4_moe" and cfg.num_rollout_workers == 2
    again = config.load(None, [f"{k}={v}" for k, v in [("trainer.lr", 0.001)]])
    assert again.trainer.lr == 0.001
    assert "max_steps: 3" in config.dump(cfg)


@pytest.mark.parametrize(
    "override,message",
    [
        ("trainer.maxsteps=3", "unknown config key.*trainer.maxsteps"),
        ("trainer.group_size=1", "group_size=1"),
        ("trainer.minibatches=3", "minibatches=3 must divide"),
        ("max_staleness=-1", "max_staleness=-1"),
        ("rollout.temperature=0", "temperature=0"),
        ("task.name=chess", "task.name='chess'"),
        ("run_id=a b", "run_id="),
        ("trainer.max_steps=ten", "trainer.max_steps: expected int"),
        ("nokey", "is not key=value"),
        # bools are ints in Python: never taken as 1 or 1.0
        ("trainer.max_steps=true", r"trainer.max_steps: expected int, got True"),
        ("trainer.lr=false", r"trainer.lr: expected float, got False"),
        ("model.overrides=[1,2,3]", r"model.overrides: expected a mapping"),
        ("trainer.betas=1_000", r"trainer.betas: expected a list of 2 values, got 1000"),
        ("trainer.betas=[0.9, x]", r"trainer.betas\[1\]: expected float"),
        ("trainer.minibatches=0", r"minibatches=0 \(must be >= 1\)"),  # not ZeroDivisionError
        ("trainer.lr=[1,2", r"override trainer.lr: YAML syntax error .*line 1"),
        ("trainer.lr=" + "[" * 3000, "override trainer.lr: YAML nested too deeply"),
        ("model.overrides={a: {b: {c: {d: {e: {f: {g: {h: {i: {j: 1}}}}}}}}}}", "nested deeper than 8"),
        ("trainer.checkpoint_every=0", r"checkpoint_every=0 \(must be >= 1\)"),
        ("rollout.metrics_port=70000", "metrics_port=70000"),
    ],
)
def test_bad_configs_name_the_problem(override, message):
    with pytest.raises(ValueError, match=message):
        config.load(None, [override])


def test_yaml_alias_bomb_is_refused_before_it_is_expanded():
    # 9 levels of 9 aliases: 311 characters that dump() would expand to 9**9 items (85 s of CPU).
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join(['*a' + str(i - 1)] * 9)}]" for i in range(1, 9)]
    bomb = "{" + ", ".join(lines) + "}"
    with pytest.raises(ValueError, match="model.overrides: value too large"):
        config.load(None, ["model.overrides=" + bomb])


def test_config_file_problems_name_the_file(tmp_path):
    with pytest.raises(ValueError, match="config file 'nope.yaml' not found"):
        config.load("nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_steps: [1\n")
    with pytest.raises(ValueError, match=r"config file '.*bad.yaml': YAML syntax error \(line 3"):
        config.load(bad)
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ValueError, match="expected a mapping at the top, got list"):
        config.load(bad)


def test_floats_written_without_a_dot_parse():
    assert config.load(None, ["trainer.lr=1e-3"]).trainer.lr == 1e-3  # YAML 1.1 reads 1e-3 as text


def test_dump_masks_the_redis_password():
    cfg = config.load(None, ["redis_url=redis://user:s3cret@redis:6379/0"])
    text = config.dump(cfg)
    assert "s3cret" not in text and "redis://user:***@redis:6379/0" in text
    assert config.redact_url("redis://redis:6379/0") == "redis://redis:6379/0"
    assert (
        config.redact_url("rediss://:p%40ss@h:1/0?ssl_ca_certs=/ca.pem") == "rediss://:***@h:1/0?ssl_ca_certs=/ca.pem"
    )


def test_env_overrides(monkeypatch):
    monkeypatch.setenv("TANDEM_REDIS_URL", "redis://:secret@redis:6379/0")
    monkeypatch.setenv("TANDEM_RUN_ID", "exp7")
    cfg = config.load(None, config.env_overrides())
    assert cfg.redis_url == "redis://:secret@redis:6379/0" and cfg.run_id == "exp7"


def test_tokenizer_and_verifier():
    tok = CharTokenizer()
    ids = tok.encode("12+7=", bos=True)
    assert ids[0] == tok.bos_id and tok.decode(ids) == "12+7="
    assert tok.decode(tok.encode("19", eos=True) + tok.encode("5")) == "19"  # stops at <eos>
    with pytest.raises(ValueError, match=r"outside the vocabulary: \['x'\]"):
        tok.encode("1x2")
    task = AdditionTask(digits=2)
    assert task.score(tok, tok.encode("19", eos=True), "19") == 1.0
    assert task.score(tok, tok.encode("19"), "19") == 0.0  # no <eos>: not a finished answer
    assert task.score(tok, tok.encode("18", eos=True), "19") == 0.0
    import random

    p, a = task.sample(random.Random(0))
    x, y = p.rstrip("=").split("+")
    assert int(x) + int(y) == int(a)
    with pytest.raises(ValueError, match="digits=0"):
        AdditionTask(digits=0)

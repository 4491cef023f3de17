"""Run configuration: YAML + key=value overrides, validation that names the offending keys."""

from __future__ import annotations

import dataclasses
import re
import typing

import pytest

from broker.tls import ClientTLS
from rollout.tasks import AdditionTask, CharTokenizer, Task, TaskConfig, make_task
from tandem import config, env_config


def test_demo_config_loads_and_overrides_apply():
    cfg = config.load("demo.yaml", ["trainer.max_steps=3", "loop.max_staleness=0", "model.overrides={n_layers: 2}"])
    assert cfg.trainer.max_steps == 3 and cfg.loop.max_staleness == 0 and cfg.model.overrides == {"n_layers": 2}
    assert cfg.recipe == "nvfp4_moe" and cfg.num_rollout_workers == 2
    assert cfg.trainer.warmstart_until == 0.4 and cfg.trainer.warmstart_steps == 300
    again = config.load(None, [f"{k}={v}" for k, v in [("trainer.lr", 0.001)]])
    assert again.trainer.lr == 0.001
    assert "max_steps: 3" in config.dump(cfg)


@pytest.mark.parametrize(
    "override,message",
    [
        ("trainer.maxsteps=3", "unknown config key.*trainer.maxsteps"),
        ("trainer.group_size=1", "group_size=1"),
        ("trainer.minibatches=3", "minibatches=3 must divide"),
        ("loop.max_staleness=-1", "max_staleness=-1"),
        ("loop.temperature=0", "temperature=0"),
        ("max_staleness=0", "unknown config key.*max_staleness.*did you mean"),
        ("task.name=chess", "task.name='chess'"),
        ("run_id=a b", "run_id="),
        ("run_id=" + "r" * 65, r"run_id='r+': want 1-64 characters"),  # the Redis keys' limit, before any process
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
        ("trainer.checkpoint_every=-1", r"checkpoint_every=-1 \(must be >= 0; 0 = never\)"),
        ("trainer.memory_fraction=1.5", r"memory_fraction=1.5 \(want 0 < f <= 1, or 0 = no cap\)"),
        ("rollout.memory_fraction=-0.1", r"memory_fraction=-0.1"),
        ("rollout.decode_priority=urgent", r"decode_priority='urgent' \(want normal or high\)"),
        ("trainer.device=gpu", r"device='gpu' \(cpu, cuda or cuda:N\)"),
        ("rollout.metrics_port=70000", "metrics_port=70000"),
        ("rollout.fetch_process=1", r"fetch_process"),
        ("rollout.fetch_processes=0", r"fetch_processes=0 \(need an int in \[1, 16\]\)"),
        ("rollout.fetch_processes=true", r"rollout.fetch_processes: expected int"),
        ("trainer.mps_thread_percentage=101", r"mps_thread_percentage=101 \(an int in \[0, 100\]"),
        ("trainer.mps_client_priority=2", r"mps_client_priority=2 \(0 normal or 1 below normal\)"),
        ("trainer.policy_server_process=2", r"policy_server_process=2 \(want true, false or null\)"),
        ("trainer.policy_server_processes=0", r"policy_server_processes=0 \(an int >= 1\)"),
        ("trainer.warmstart_until=1.5", r"warmstart_until=1.5 \(an accuracy in \[0, 1\]; 0 = off\)"),
    ],
)
def test_bad_configs_name_the_problem(override, message):
    with pytest.raises(ValueError, match=message):
        config.load(None, [override])


def test_several_serving_processes_need_the_server_in_child_processes():
    bad = ["trainer.policy_server_processes=2", "trainer.policy_server_process=false"]
    with pytest.raises(ValueError, match="policy_server_processes=2 with policy_server_process=false"):
        config.load(None, bad)
    assert config.load(None, bad[:1]).trainer.policy_server_processes == 2


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
    assert env_config.redact_url("redis://redis:6379/0") == "redis://redis:6379/0"
    assert (
        env_config.redact_url("rediss://:p%40ss@h:1/0?ssl_ca_certs=/ca.pem")
        == "rediss://:***@h:1/0?ssl_ca_certs=/ca.pem"
    )


def _every_key(cls, path: str = "") -> list[str]:
    """Every dotted key under dataclass `cls`: its sections and their leaves."""
    keys, hints = [], typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        keys.append(path + f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            keys += _every_key(hints[f.name], f"{path}{f.name}.")
    return keys


def test_no_explanation_ends_mid_sentence():
    keys = ["", *_every_key(config.RunConfig)]
    assert "model" in keys and "trainer.tls.cert" in keys
    for key in keys:
        for line in config.explain(key).splitlines():
            assert line.endswith("."), (key, line[-80:])
    # A section's summary is its docstring's whole first paragraph, however many lines it spans.
    assert config.explain("model").splitlines()[0].endswith("only `max_seq_len` may differ).")


def test_explain_shows_attribute_docstrings_and_unknown_keys_say_what_they_meant(capsys):
    assert config.explain("loop.max_staleness").startswith("loop.max_staleness (int, default 2): Samples more than")
    assert "default 8): Samples per prompt" in config.explain("trainer.group_size")
    section = config.explain("trainer.tls")
    assert "trainer.tls.client_ca (str, default ''): PEM CA" in section
    top = config.explain("")
    assert "loop (section): Run-wide settings" in top and "run_id (str, default 'demo')" in top
    with pytest.raises(ValueError, match="unknown config key 'trainer.maxsteps'; did you mean trainer.max_steps"):
        config.explain("trainer.maxsteps")
    with pytest.raises(ValueError, match=r"did you mean trainer.max_steps: Optimizer steps of the run"):
        config.load(None, ["trainer.maxsteps=3"])
    # Every field of every section is documented.
    for cls in (config.RunConfig, config.TrainerConfig, config.RolloutConfig, config.AsyncConfig, config.TaskConfig):
        missing = {f.name for f in dataclasses.fields(cls)} - set(config.field_docs(cls))
        assert not missing, (cls.__name__, missing)
    # The command: the text on stdout, exit 0; a bad key: one line on stderr, exit 2.
    from tandem.cli import main

    assert main(["run", "--explain", "loop.temperature"]) == 0
    assert "loop.temperature (float, default 1.0)" in capsys.readouterr().out
    assert main(["run", "--explain", "loop.temp"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean loop.temperature" in err
    # A config key that moved: one line naming where it went, exit 2, nothing started.
    assert main(["run", "demo.yaml", "max_staleness=0", "--run-dir", "/nonexistent/never-created"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean loop.max_staleness" in err


def test_env_overrides(monkeypatch):
    monkeypatch.setenv("TANDEM_REDIS_URL", "redis://:secret@redis:6379/0")
    monkeypatch.setenv("TANDEM_RUN_ID", "exp7")
    cfg = config.load(None, env_config.env_overrides())
    assert cfg.redis_url == "redis://:secret@redis:6379/0" and cfg.run_id == "exp7"


def test_tokenizer_and_verifier():
    tok = CharTokenizer()
    ids = tok.encode("12+7=", bos=True)
    assert ids[0] == tok.bos_id and tok.decode(ids) == "12+7="
    assert tok.decode(tok.encode("19", eos=True) + tok.encode("5")) == "19"  # stops at <eos>
    with pytest.raises(ValueError, match=r"outside the vocabulary: \['x'\]"):
        tok.encode("1x2")
    task = AdditionTask(digits=2)
    assert task.score(tok.encode("19", eos=True), {"answer": "19"}) == 1.0
    assert task.score(tok.encode("19"), {"answer": "19"}) == 0.0  # no <eos>: not a finished answer
    assert task.score(tok.encode("18", eos=True), {"answer": "19"}) == 0.0
    import random

    p, a = task.sample(random.Random(0))
    x, y = p.rstrip("=").split("+")
    assert int(x) + int(y) == int(a)
    with pytest.raises(ValueError, match="digits=0"):
        AdditionTask(digits=0)


def not_a_task(cfg, *, seed):
    return object()


def test_tasks_are_plugins_selected_by_name():
    """A built-in by name and a user's module:attr factory give the same task; prompts are a pure
    function of (seed, index) and carry what the verifier needs."""
    built_in = make_task(TaskConfig(name="addition", digits=2), seed=3)
    plugin = make_task(TaskConfig(name="rollout.tasks:make_addition", digits=2), seed=3)
    assert isinstance(built_in, Task) and built_in.max_new_tokens == 4
    p, q = built_in.prompt(7), plugin.prompt(7)
    assert p == q and p != built_in.prompt(8)
    assert make_task(TaskConfig(digits=2), seed=4).prompt(7) != p  # the seed matters
    text = built_in.tokenizer.decode(p.tokens)
    a, b = text.rstrip("=").split("+")
    assert str(int(a) + int(b)) == p.fields["answer"]
    assert built_in.score(p.reference, p.fields) == 1.0
    with pytest.raises(ValueError, match="task.name='no_such_module:f': cannot load"):
        make_task(TaskConfig(name="no_such_module:f"), seed=0)
    with pytest.raises(ValueError, match="factory.*failed"):
        make_task(TaskConfig(name="rollout.tasks:TaskConfig"), seed=0)
    with pytest.raises(ValueError, match="returned object, not a Task"):
        make_task(TaskConfig(name="test_run_config:not_a_task"), seed=0)


def test_the_megatron_backend_is_refused_without_cuda(tmp_path):
    """megatron's GPTModel runs on CUDA only: on the CPU the setting is refused with one line naming
    the field (the config), and device=cuda on a machine without a GPU is refused by the trainer."""
    import torch

    from tandem.services import make_trainer

    with pytest.raises(ValueError, match="backend='megatron' needs device='cuda'"):
        config.load(
            "configs/demo.yaml", ["trainer.backend=megatron", "trainer.device=cpu", "trainer.warmstart_until=0"]
        )
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    cfg = config.load(
        "configs/demo.yaml", ["trainer.backend=megatron", "trainer.device=cuda", "trainer.warmstart_until=0"]
    )
    with pytest.raises(ValueError, match="trainer.device='cuda' but torch sees no CUDA device"):
        make_trainer(cfg, tmp_path)


def test_gpu_h200_config_loads_and_shares_one_gpu():
    # configs/gpu-h200.yaml: trainer and 2 workers on one GPU, their memory caps leaving room for
    # three CUDA contexts; no checkpoints (52 GB each at this size), no reflection (not on the image).
    cfg = config.load("configs/gpu-h200.yaml")
    assert cfg.trainer.device == "cuda" and cfg.rollout.device == "cuda" and cfg.num_rollout_workers == 2
    total = cfg.trainer.memory_fraction + cfg.num_rollout_workers * cfg.rollout.memory_fraction
    assert 0 < cfg.rollout.memory_fraction and 0.9 <= total <= 0.97
    assert cfg.trainer.checkpoint_every == 0 and cfg.trainer.grpc_reflection is False
    assert cfg.model.checkpoint and cfg.recipe == "nvfp4_moe" and cfg.task.name == "jsonl"
    assert cfg.rollout.max_batch == cfg.trainer.group_size  # one group per generate call, one graph


def test_gpu_h200_long_config_is_the_long_workload_and_says_so():
    # configs/gpu-h200-long.yaml: >= 256 samples of 1,024 tokens per step, slots kept full, and the
    # benchmark-only knob on (rollout.ignore_stop) with room for prompt + completion in the KV.
    cfg = config.load("configs/gpu-h200-long.yaml")
    assert cfg.trainer.groups_per_step * cfg.trainer.group_size >= 256
    assert cfg.task.max_new_tokens == 1024 and cfg.rollout.ignore_stop is True
    assert cfg.rollout.max_inflight_groups * cfg.trainer.group_size >= cfg.rollout.max_batch
    assert (
        cfg.rollout.kv_capacity > cfg.task.max_new_tokens
        and cfg.model.overrides["max_seq_len"] >= cfg.rollout.kv_capacity
    )
    assert cfg.trainer.microbatch_tokens > 0
    assert config.RunConfig().rollout.ignore_stop is False  # never the default


def test_loop_inflight_updates_is_a_bool_named_in_its_error():
    assert config.load(None, ["loop.inflight_updates=true"]).loop.inflight_updates is True
    assert config.load(None, []).loop.inflight_updates is False  # drain-on-swap by default
    with pytest.raises(ValueError, match="loop.inflight_updates: expected bool"):
        config.load(None, ["loop.inflight_updates=3"])
    with pytest.raises(ValueError, match=r"inflight_updates=1 \(must be true or false\)"):
        config.AsyncConfig(inflight_updates=1)
    assert "drain-on-swap" in config.explain("loop.inflight_updates")


def test_relay_keys_are_checked_with_one_line_naming_the_key():
    from rollout.config import RolloutConfig
    from trainer.config import TrainerConfig

    for kw, says in (
        ({"relay_port": 70000}, "relay_port=70000"),
        ({"relay_advertise": "no-port"}, "relay_advertise='no-port'"),
        ({"relay_timeout_s": 0}, "relay_timeout_s=0"),
        ({"relay": "yes"}, "relay='yes'"),
        ({"relay_server_name": "a b"}, "relay_server_name='a b'"),
        ({"relay": True, "tls": ClientTLS(ca=__file__)}, "relay=true with rollout.tls needs tls.cert"),
    ):
        with pytest.raises(ValueError, match=re.escape(says)):
            RolloutConfig(**kw)
    with pytest.raises(ValueError, match=re.escape("relay_fanout=65 (an int in [0, 64]")):
        TrainerConfig(relay_fanout=65)
    assert RolloutConfig(relay=True, relay_advertise="10.0.0.1:50052").relay_timeout_s == 20.0


def test_loop_routing_replay_is_a_bool_and_refused_with_megatron():
    assert config.load(None, ["loop.routing_replay=true"]).loop.routing_replay is True
    assert config.load(None, []).loop.routing_replay is False
    with pytest.raises(ValueError, match="loop.routing_replay: expected bool"):
        config.load(None, ["loop.routing_replay=3"])
    with pytest.raises(ValueError, match=r"routing_replay=1 \(must be true or false\)"):
        config.AsyncConfig(routing_replay=1)
    assert "uint8" in config.explain("loop.routing_replay")
    with pytest.raises(ValueError, match="loop.routing_replay=true with trainer.backend='megatron'"):
        config.load(None, ["loop.routing_replay=true", "trainer.backend=megatron", "trainer.device=cuda"])

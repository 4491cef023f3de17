"""What a person typing `tandem ...` sees: every class of bad input gives exit status 2, one line on
stderr that names the key, value or file, and never a traceback; nothing is started for a config
that cannot run; output piped into `head` ends quietly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def tandem(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 120):
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )


def assert_one_line_error(res, *needles: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stdout[-2000:], res.stderr[-2000:])
    assert "Traceback" not in res.stderr + res.stdout
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize(
    "args,needles",
    [
        (["run", "trainer.lr=[1,2"], ["trainer.lr", "YAML syntax error"]),
        (["run", "trainer.lr=" + "[" * 3000], ["trainer.lr", "nested too deeply"]),
        (["run", "missing.yaml"], ["missing.yaml", "not found"]),
        (["run", "trainer.max_steps=true"], ["trainer.max_steps", "True"]),  # no config file: the demo's
        (["run", "model.overrides=[1,2,3]"], ["model.overrides"]),
        (["run", "trainer.betas=1_000"], ["trainer.betas", "1000"]),
        (["run", "trainer.minibatches=0"], ["minibatches=0"]),
        (["run", "recipe=nvfp5"], ["unknown recipe 'nvfp5'"]),
        (["run", "model.preset=huge"], ["unknown model preset 'huge'"]),
        (["run", "model.overrides={nlayers: 2}"], ["nlayers"]),
        (
            ["run", "redis_url=redis://:pw@127.0.0.1:1/0"],
            ["cannot reach Redis at redis://:***@127.0.0.1:1/0", "refused"],
        ),
        (["trainer"], ["--config FILE or set TANDEM_CONFIG"]),
        (["rollout"], ["--config FILE or set TANDEM_CONFIG"]),
        (["trainer", "--config", "demo.yaml", "recipe=nvfp5"], ["unknown recipe"]),
        (["plan", "nvfp5"], ["unknown recipe 'nvfp5'"]),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, needles):
    res = tandem(*args, cwd=tmp_path, env={"TANDEM_CONFIG": ""})
    assert_one_line_error(res, *needles)
    assert not (tmp_path / "runs").exists(), "nothing may be started or created for a config that cannot run"
    assert "password" not in res.stderr and ":pw@" not in res.stderr


def test_explain_a_section_gives_its_whole_summary(tmp_path):
    res = tandem("run", "--explain", "model", cwd=tmp_path)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    head = res.stdout.splitlines()[0]
    assert head.startswith("model: The model:") and head.endswith("only `max_seq_len` may differ)."), head


def test_yaml_syntax_error_in_the_file_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run_id: x\ntrainer: {max_steps: 3\n")
    assert_one_line_error(tandem("run", str(bad), cwd=tmp_path), "bad.yaml", "YAML syntax error", "line 3")


def test_version_and_formats_help():
    res = tandem("--version")
    assert res.returncode == 0 and res.stdout.startswith("tandem ")
    res = tandem("formats", "--help")
    assert res.returncode == 0
    for flag, words in (("--rows", "rows M"), ("--cols", "columns K"), ("--seed", "seed of the generated")):
        assert flag in res.stdout and words in res.stdout


@pytest.mark.parametrize(
    "args", [["plan", "nvfp4_moe", "--model", "qwen3-30b-a3b", "--json"], ["formats", "--rows", "128", "--cols", "128"]]
)
def test_a_closed_pipe_ends_quietly(args):
    # `tandem plan ... --json | head -c 100`: the reader goes away after a few bytes.
    proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(100)
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert b"Traceback" not in err and b"BrokenPipeError" not in err, err.decode()[-2000:]
    assert proc.returncode in (0, 141)

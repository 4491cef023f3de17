"""What a person typing `tandem ...` sees: every class of bad input gives exit status 2, one line on
stderr that names the key, value or file, and never a traceback; nothing is started for a config
that cannot run; output piped into `head` ends quietly."""

from __future__ import annotations

import os
import socket
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
        (["run", "num_rollout_workers=0"], ["num_rollout_workers=0", "at least 1 rollout worker"]),
        (["run", "model.preset=qwen3-235b-a22b"], ["model.preset='qwen3-235b-a22b'", "GB on cpu"]),
        (["run", "model.overrides={dim: 1048576, n_layers: 4096}"], ["'dim': 1048576", "GB on cpu"]),
        (["run", "trainer.tls.cert=/nope", "trainer.tls.key=/nope"], ["trainer.tls.cert='/nope' is not a file"]),
        (["run", "rollout.tls.ca=/nope/ca.pem"], ["rollout.tls.ca='/nope/ca.pem' is not a file"]),
        (["run", "run_secret_file=/nope"], ["run_secret_file='/nope'"]),
        (["run", "trainer.grpc_port=9000", "trainer.metrics_port=9000"], ["trainer.metrics_port=9000", "one port"]),
        (["run", "rollout.device=cuda:7"], ["rollout.device='cuda:7'", "CUDA device"]),
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


@pytest.fixture
def held_port():
    """A port another program listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.slow
def test_a_taken_port_is_named_with_its_key_before_anything_starts(tmp_path, held_port):
    p = held_port
    for args, needle in (
        (["run", f"trainer.grpc_port={p}"], f"trainer.grpc_port={p}: cannot bind 127.0.0.1:{p}"),
        (["run", f"trainer.metrics_port={p}"], f"trainer.metrics_port={p}: cannot bind 127.0.0.1:{p}"),
        # two workers on a fixed port: w1 binds the next one, which is taken
        (["run", f"rollout.metrics_port={p - 1}"], f"rollout.metrics_port={p - 1} (w1's port {p}): cannot bind"),
        # the services on their own (Kubernetes), and a worker whose port was taken since the launcher's check
        (["trainer", "--config", "demo.yaml", f"trainer.metrics_port={p}"], f"trainer.metrics_port={p}"),
        (["rollout", "--config", "demo.yaml", f"rollout.metrics_port={p}"], f"rollout.metrics_port={p}"),
    ):
        res = tandem(*args, cwd=tmp_path, env={"TANDEM_CONFIG": ""})
        assert_one_line_error(res, needle, "Address already in use")
        assert not list(tmp_path.iterdir()), "nothing may be created for a port that cannot be bound"


def test_a_file_the_services_would_read_from_the_environment_is_checked_up_front(tmp_path):
    res = tandem("run", cwd=tmp_path, env={"TANDEM_ROLLOUT_TLS_CA": "/nope/ca.pem"})
    assert_one_line_error(res, "rollout.tls.ca='/nope/ca.pem' is not a file")
    assert not list(tmp_path.iterdir())


def test_a_folder_that_is_no_run_folder_is_left_alone(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o755)
    (mine / "notes.txt").write_text("my notes")
    res = tandem("run", "--run-dir", str(mine), cwd=tmp_path)
    assert_one_line_error(res, f"--run-dir {mine}: not empty (notes.txt) and not a run folder")
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine.stat().st_mode & 0o777) == 0o755


def test_a_resume_with_other_settings_names_them_and_needs_a_flag(tmp_path):
    from tandem import config

    run = tmp_path / "run"
    run.mkdir()
    before = config.dump(config.load("demo.yaml", ["redis_url=redis://127.0.0.1:7000"]))  # as the launcher writes it
    (run / "config.yaml").write_text(before)
    res = tandem("run", "--run-dir", str(run), "trainer.lr=0.01", "trainer.max_steps=7", cwd=tmp_path)
    # max_steps may change (a longer run); the learning rate needs --accept-changes
    assert_one_line_error(res, "trainer.lr: 0.0003 -> 0.01; pass --accept-changes")
    assert "max_steps" not in res.stderr
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml"] and (run / "config.yaml").read_text() == before


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

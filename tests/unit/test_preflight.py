"""tandem.preflight's rules, checked by hand: the run's ports, parameter memory, run folders and
what a resume changes."""

from __future__ import annotations

import pytest

from tandem import config, preflight


def cfg(*overrides: str) -> config.RunConfig:
    return config.load(None, list(overrides))


def test_worker_ports_are_the_base_plus_the_index_and_free_ports_stay_free():
    plan = preflight.port_plan(cfg("rollout.metrics_port=9100", "trainer.metrics_port=-1"), workers=3)
    assert plan == {
        "trainer": {"trainer.grpc_port": ("127.0.0.1", 0)},  # metrics off, health off by default
        "w0": {"rollout.metrics_port": ("127.0.0.1", 9100)},
        "w1": {"rollout.metrics_port": ("127.0.0.1", 9101)},
        "w2": {"rollout.metrics_port": ("127.0.0.1", 9102)},
    }
    plan = preflight.port_plan(cfg("trainer.health.port=0", "trainer.health.host=10.0.0.5"), workers=1)
    assert plan["trainer"]["trainer.health.port"] == ("10.0.0.5", 0)
    assert plan["w0"] == {"rollout.metrics_port": ("127.0.0.1", 0)}
    # A relaying worker's relay port is one of its ports (base + index), bound on rollout.relay_host.
    plan = preflight.port_plan(cfg("rollout.relay=true", "rollout.relay_port=7000", "rollout.metrics_port=-1"), 2)
    assert plan["w0"] == {"rollout.relay_port": ("127.0.0.1", 7000)}
    assert plan["w1"] == {"rollout.relay_port": ("127.0.0.1", 7001)}


def test_free_ports_are_picked_apart_below_the_ephemeral_range():
    """Port 0 becomes a port no program's own port 0 (or outgoing connection) can take before the
    service binds it: below /proc/sys/net/ipv4/ip_local_port_range, one per key."""
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    plan = preflight.port_plan(cfg("trainer.metrics_port=0", "trainer.health.port=0", "rollout.health.port=0"), 8)
    bound = preflight.bind_ports(plan)
    ports = [port for keys in bound.values() for _, port in keys.values()]
    assert len(ports) == 1 + 2 + 8 * 2 and len(set(ports)) == len(ports)
    assert all(preflight.PICK_FROM <= p < low for p in ports), ports


def test_two_keys_on_one_port_are_refused_naming_both():
    with pytest.raises(ValueError, match=r"trainer.grpc_port=9000 and trainer.metrics_port=9000: one port"):
        preflight.port_plan(cfg("trainer.grpc_port=9000", "trainer.metrics_port=9000"), workers=1)
    # w1's port is the base + 1: it collides with the trainer's 9001
    with pytest.raises(ValueError, match=r"trainer.metrics_port=9001 and rollout.metrics_port=9000 \(w1's port 9001\)"):
        preflight.port_plan(cfg("trainer.metrics_port=9001", "rollout.metrics_port=9000"), workers=2)


def test_parameter_memory_per_device():
    one_b = 10**9
    assert preflight.memory_needed(one_b, cfg(), workers=2) == {"cpu": 16 * one_b + 2 * 4 * one_b}
    gpu = cfg("trainer.device=cuda", "rollout.device=cuda")
    assert preflight.memory_needed(one_b, gpu, workers=2) == {"cuda:0": 16 * one_b}
    preflight.check_memory(cfg(), one_b, 2, capacity=lambda d: 24 * one_b)  # exactly fits
    with pytest.raises(ValueError, match=r"model.preset='tiny': 1.0B parameters need at least 24.0 GB on cpu.*23.0 GB"):
        preflight.check_memory(cfg(), one_b, 2, capacity=lambda d: 23 * one_b)


def test_run_folders(tmp_path):
    assert preflight.check_run_folder(tmp_path / "new") is False
    assert preflight.check_run_folder(tmp_path) is False  # empty
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"not empty \(notes.txt\) and not a run folder"):
        preflight.check_run_folder(tmp_path)
    (tmp_path / "study-run.yaml").write_text("{}")  # a study's run folder, before its first run
    assert preflight.check_run_folder(tmp_path) is False
    (tmp_path / "config.yaml").write_text("{}")
    assert preflight.check_run_folder(tmp_path) is True
    with pytest.raises(ValueError, match="not a folder"):
        preflight.check_run_folder(tmp_path / "notes.txt")


def test_what_a_resume_changes():
    old = cfg("redis_url=redis://127.0.0.1:7000", "run_secret_file=/run/x/run.secret", "trainer.max_steps=10")
    new = cfg("trainer.lr=0.01", "trainer.max_steps=20", "model.overrides={n_layers: 2}", "rollout.metrics_port=9100")
    diff = preflight.changes(old, new)
    assert diff == [
        ("model.overrides.n_layers", preflight.UNSET, 2),
        ("rollout.metrics_port", 0, 9100),
        ("trainer.lr", 0.0003, 0.01),
        ("trainer.max_steps", 10, 20),
    ]  # the private Redis and the run secret are the launcher's to fill in
    assert [k for k, _, _ in preflight.needs_acceptance(diff)] == ["model.overrides.n_layers", "trainer.lr"]
    assert preflight.describe(diff[2:3]) == "trainer.lr: 0.0003 -> 0.01"
    assert preflight.changes(old, cfg("redis_url=redis://elsewhere:6379"))[0][0] == "redis_url"

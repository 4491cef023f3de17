"""Relays end to end: a real redis-server, the trainer and three rollout workers as separate
processes (`tandem trainer`, `tandem rollout`), every worker relaying (rollout.relay) and the trainer
publishing a chain (trainer.relay_fanout=1: trainer -> w1 -> w2 -> w3).

Every worker converges to the newest version; w2 and w3 fetch from their relays (their "live" lines
name the source, their metrics count it); the trainer's server sends about one copy per version
(policy_sent_bytes in metrics.jsonl; deltas off, so a copy is a full version); and every sample was
trained under a version its worker had live. Relays over mTLS with the workers' certificate. And
one worker driven without Redis (in process and in a fetch child): a dead relay passed over and
counted, a relay's flipped bytes refused and that relay distrusted for that version only, a fetch
waiting on a relay cancelled at once by a newer pointer.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import yaml
from loop_run import lines, spawn, stop, wait

from broker.keys import Keys
from broker.registry import PolicyRegistry
from broker.signing import load_signer, write_secret_file
from broker.streams import connect, run_async

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WORKERS = ("w1", "w2", "w3")
LIVE = re.compile(r"(\w+): policy v(\d+) live \((\d+) bytes.*\((?:[^()]*), from (\S+), \d+ stream\(s\)")


def relay_config(tmp: Path, run_id: str, redis_url: str, *, max_steps: int = 1000, **trainer) -> Path:
    """A signed run of a small bf16 model, deltas off (a copy of a version is the full version),
    every worker relaying; `trainer` adds trainer keys."""
    secret = tmp / "run.secret"
    if not secret.exists():
        write_secret_file(secret)
    cfg = {
        "run_id": run_id,
        "redis_url": redis_url,
        "run_secret_file": str(secret),
        "num_rollout_workers": len(WORKERS),
        "loop": {"max_staleness": 1, "seed": 5},
        "recipe": "bf16",
        "model": {
            "preset": "tiny",
            "overrides": {"n_layers": 1, "dim": 32, "n_experts": 2, "expert_ffn_dim": 32, "shared_expert_ffn_dim": 32},
        },
        "task": {"digits": 1},
        "trainer": {
            "max_steps": max_steps, "groups_per_step": 2, "group_size": 4, "minibatches": 1, "warmstart_steps": 2,
            "warmstart_batch": 8, "metrics_port": -1, "collect_timeout_s": 90.0, "relay_fanout": 1,
            "policy_deltas": False, "publish_every": 4, **trainer,
        },
        "rollout": {
            "reclaim_idle_s": 2.0, "heartbeat_s": 0.5, "heartbeat_ttl_s": 3.0, "read_block_ms": 200,
            "relay": True, "relay_timeout_s": 20.0,
        },
    }  # fmt: skip
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def live_lines(log: Path) -> list[tuple[int, int, str]]:
    """(version, bytes, source) of each "policy vN live" line of a worker's log."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return [(int(m[2]), int(m[3]), m[4]) for m in LIVE.finditer(text)]


def relay_address(log: Path) -> str | None:
    m = re.search(r"relay for peers on \S+ \(advertised (\S+)\)", log.read_text(errors="replace"))
    return m and m[1]


def pointer_version(redis_url: str, run_id: str, secret: Path) -> int:
    async def main():
        r = connect(redis_url)
        try:
            p = await PolicyRegistry(r, Keys(run_id=run_id), load_signer(str(secret))).latest()
        finally:
            await r.aclose()
        return p.version if p else 0

    return run_async(main())


def assert_trained_under_live_versions(run_dir: Path, logs: Path) -> None:
    """No sample trained under a version its worker did not have live (verified) when it made it."""
    live = {w: {v for v, _, _ in live_lines(logs / f"{w}.log")} for w in WORKERS}
    for row in lines(run_dir / "audit.jsonl"):
        for group_id, version, worker, *_ in row["groups"]:  # then the oldest token's version
            assert version in live.get(worker, ()), f"{group_id}: v{version} never live on {worker}"


def test_a_chain_of_relays_carries_every_version_at_one_trainer_copy_each(tmp_path, redis_url, run_id):
    cfg = relay_config(tmp_path, run_id, redis_url)
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    # w2 fetches in a child process (rollout.fetch_process), w1 and w3 in process.
    extra = {"w2": ["rollout.fetch_process=true", "rollout.fetch_processes=1"]}
    workers = {
        w: spawn(["rollout", "--config", str(cfg), "--worker-id", w, *extra.get(w, [])], logs / f"{w}.log")
        for w in WORKERS
    }
    wait(lambda: all(relay_address(logs / f"{w}.log") for w in WORKERS), "the relays", 120, workers.values())
    trainer = spawn(["trainer", "--config", str(cfg), "--run-dir", str(run_dir)], logs / "trainer.log")
    procs = [trainer, *workers.values()]
    try:
        wait(lambda: len(lines(run_dir / "metrics.jsonl")) >= 8, "eight steps", 300, procs)
        for w in ("w2", "w3"):  # versions come faster than a chain of three carries them: some are skipped
            wait(lambda w=w: len(live_lines(logs / f"{w}.log")) >= 4, f"four versions live on {w}", 240, procs)
        newest = pointer_version(redis_url, run_id, tmp_path / "run.secret")
        for w in WORKERS:  # converged: the newest version at the time (or a newer one) live on each
            wait(
                lambda w=w: max((v for v, _, _ in live_lines(logs / f"{w}.log")), default=0) >= newest,
                f"{w} at v{newest}", 120, procs,
            )  # fmt: skip
        row = lines(run_dir / "metrics.jsonl")[-1]
    finally:
        stop(procs)

    relays = {w: relay_address(logs / f"{w}.log") for w in WORKERS}
    got = {w: live_lines(logs / f"{w}.log") for w in WORKERS}
    trainer_address = next(s for _, _, s in got["w1"])
    assert all(s == trainer_address for _, _, s in got["w1"]), got["w1"]  # the head fetches from the trainer
    # w2 and w3 fetched from their relays (w3 from w2, or from w1 when w2 did not have it in time).
    for w, parents in (("w2", {relays["w1"]}), ("w3", {relays["w2"], relays["w1"]})):
        from_relays = [v for v, _, s in got[w] if s in parents]
        assert len(from_relays) >= len(got[w]) // 2 >= 1, (w, got[w])
    assert "delta against" not in (logs / "w1.log").read_text()  # deltas off: every copy is whole
    # The trainer's egress: about one full version per published version, not one per worker.
    full = got["w1"][0][1]
    versions = row["policy_version"]
    assert row["relays"] == 3
    assert 0 < row["policy_sent_bytes"] <= 1.5 * full * versions, (row["policy_sent_bytes"], full, versions)
    assert_trained_under_live_versions(run_dir, logs)


def test_relays_speak_mutual_tls_with_the_workers_certificate(tmp_path, redis_url, run_id):
    """With rollout.tls each relay presents the worker certificate and requires a peer's: w2 fetches
    from w1's relay over mTLS, checking the certificate's name (rollout.relay_server_name)."""
    from tls_certs import make_certs

    certs = tmp_path / "certs"
    certs.mkdir()
    make_certs(certs, ("trainer", "rollout"), san="IP:127.0.0.1,DNS:tandem-rollout")
    cfg = relay_config(tmp_path, run_id, redis_url)
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    tls = [f"rollout.tls.ca={certs / 'ca.crt'}", f"rollout.tls.cert={certs / 'rollout.crt'}",
           f"rollout.tls.key={certs / 'rollout.key'}", "rollout.relay_server_name=tandem-rollout"]  # fmt: skip
    workers = {
        w: spawn(["rollout", "--config", str(cfg), "--worker-id", w, *tls], logs / f"{w}.log") for w in WORKERS[:2]
    }
    wait(lambda: all(relay_address(logs / f"{w}.log") for w in workers), "the relays", 120, workers.values())
    trainer = spawn(
        ["trainer", "--config", str(cfg), "--run-dir", str(run_dir), f"trainer.tls.cert={certs / 'trainer.crt'}",
         f"trainer.tls.key={certs / 'trainer.key'}", f"trainer.tls.client_ca={certs / 'ca.crt'}"],
        logs / "trainer.log",
    )  # fmt: skip
    procs = [trainer, *workers.values()]
    try:
        w1 = relay_address(logs / "w1.log")
        wait(
            lambda: any(s == w1 for _, _, s in live_lines(logs / "w2.log")), "w2 fetching from w1 over mTLS", 240, procs
        )
    finally:
        stop(procs)
    assert "TLSHandshakeError" not in (logs / "w2.log").read_text()


# ------------------------------------------------- one worker's fetch over its sources (no Redis)
@pytest.fixture(params=[False, True], ids=["in-process", "child-process"])
def one_worker(request):
    """A CPU worker driven through its public methods (tests/drive_worker.py), a trainer's server
    holding v1..v3 and a peer's relay holding none (the worker fetching in process, then in a child); `pointer(v, relays)` names the worker second in a
    chain behind those relays."""
    import dataclasses

    from test_worker_prefetch import CFG, build

    from broker.policy_server import PolicyServer, PolicyServerConfig
    from broker.registry import PolicyPointer
    from broker.relay import Relay
    from policy.manifest import manifest_digest
    from tandem.services import make_worker

    rollout = dataclasses.replace(CFG.rollout, relay_timeout_s=20.0, fetch_streams=1, fetch_process=request.param)
    cfg = dataclasses.replace(CFG, rollout=rollout)
    worker = make_worker(cfg, "w9")
    logs: list[str] = []
    worker.log = logs.append
    server, relay = PolicyServer(PolicyServerConfig(keep_versions=4)), Relay(PolicyServerConfig(keep_versions=2))
    server.start()
    relay.start()
    digests = {}
    for v in (1, 2, 3):
        policy = build(v)
        digests[v] = manifest_digest(policy.manifest).hex()
        server.publish(policy)

    def pointer(v: int, relays: tuple[str, ...]) -> PolicyPointer:
        members = tuple((f"w{i}", a) for i, a in enumerate(relays)) + (("w9", "127.0.0.1:1"),)
        return PolicyPointer(
            version=v, address=server.address, contract_fingerprint=worker.fingerprint, content_digest=digests[v],
            fanout=1, relays=members,
        )  # fmt: skip

    yield worker, logs, pointer, server, relay
    worker.fetching.close()
    relay.stop()
    server.stop()


async def test_a_dead_relay_is_passed_over_and_counted(one_worker, free_port):
    from drive_worker import load

    worker, logs, pointer, server, _ = one_worker
    dead = f"127.0.0.1:{free_port()}"
    assert await load(worker, pointer(1, (dead,)))
    assert worker.version == 1 and worker.stats.policy_relay_fallbacks == 1 and worker.stats.policy_relay_fetches == 0
    (line,) = [ln for ln in logs if "relay fallback" in ln]
    assert f"relay {dead} failed for v1" in line and "connection refused" in line
    assert f"from {server.address}" in [ln for ln in logs if "live (" in ln][-1]
    values = worker.metric_values()
    assert (
        values["policy_relay_fallbacks"] == 1 and values["policy_fetch_failures"] == 0
    )  # the trainer's fetch did not fail


async def test_a_superseded_fetch_waiting_on_a_relay_is_cancelled_at_once(one_worker):
    """The relay does not hold v2 (its worker has not fetched it): the fetch waits for it there, up to
    relay_timeout_s (20 s). A newer pointer cancels that wait at once, and v3 comes from the relay as
    soon as the relay holds it."""

    from drive_worker import load

    worker, logs, pointer, server, relay = one_worker
    assert await load(worker, pointer(1, ()))  # v1 from the trainer: the fetch child (if any) is up
    relay.offer(*_whole(server, 1))  # the relay holds v1 only: NOT_FOUND for v2
    assert not await worker.offer(pointer(2, (relay.address,)))
    await worker.wait_fetch(1.0)
    assert worker.swap.pending is not None and not worker.swap.fetched  # still waiting on the relay
    t0 = time.monotonic()
    relay.offer(*_whole(server, 3))
    assert await load(worker, pointer(3, (relay.address,)))
    assert time.monotonic() - t0 < 10, "the superseded fetch held the worker up to its relay deadline"
    assert worker.version == 3 and worker.stats.policy_relay_fetches == 1 and worker.stats.policy_relay_fallbacks == 0
    assert "w9: v3 announced while fetching v2: superseded" in logs
    assert f"from {relay.address}" in [ln for ln in logs if "live (" in ln][-1]


def _whole(server, version: int):
    """(manifest, name -> verified bytes) of a version fetched whole from `server`."""
    from broker.policy_client import PolicyClient, PolicyClientConfig

    with PolicyClient(PolicyClientConfig(address=server.address)) as c:
        fetched = c.fetch(version)
    return fetched.manifest, fetched.data


async def test_a_relay_serving_flipped_bytes_is_distrusted_for_that_version(one_worker):
    """Bytes failing the manifest's checksums: refused, the relay not asked for that version again
    (rollout/sources.py), the version fetched from the trainer; asked again for the next version."""
    import numpy as np
    from drive_worker import load

    worker, logs, pointer, server, relay = one_worker
    manifest, data = _whole(server, 1)
    data = dict(data)
    name = max(data, key=lambda n: len(data[n]))
    data[name] = np.array(data[name], copy=True)
    data[name][7] ^= 0x10
    relay.offer(manifest, data)
    p1 = pointer(1, (relay.address,))
    assert await load(worker, p1)
    assert worker.version == 1 and f"from {server.address}" in [ln for ln in logs if "live (" in ln][-1]
    assert worker.swap.distrusted == {(1, relay.address, p1.content_digest)}
    assert worker.metric_values()["policy_sources_distrusted"] == 1 and worker.stats.policy_relay_fallbacks == 1
    (line,) = [ln for ln in logs if "relay fallback" in ln]
    assert "ChecksumMismatch" in line and "not asked for it again" in line
    relay.offer(*_whole(server, 2))  # an honest v2: a relay distrusted for v1 only
    assert await load(worker, pointer(2, (relay.address,)))
    assert f"from {relay.address}" in [ln for ln in logs if "live (" in ln][-1]

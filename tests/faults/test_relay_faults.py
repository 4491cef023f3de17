"""Relays under faults, with real processes (the trainer and relaying workers as `tandem trainer` /
`tandem rollout`, a real redis-server, trainer.relay_fanout=1: a chain):
1. a relay SIGKILLed mid-transfer (its reader's stream stalled halfway by tests/faults/proxy.py): the
   reader falls back to the trainer and keeps training;
2. a relay serving flipped bytes (a rogue one, heartbeating at the head of the chain with a real
   broker.relay server): refused by every reader, counted, fallen back from, never live;
3. the trainer SIGKILLed and restarted while a relay still serves the lost steps' versions: the
   restart numbers its versions above them, readers are served only the new ones and converge.
Each ends with the exactly-once audit (tests/faults/harness.py), and no sample trained under a
version its worker did not have live.
"""

from __future__ import annotations

import asyncio
import re
import signal
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from harness import Run, audit, config, lines, trained_by
from proxy import Proxy

from broker.keys import Keys
from broker.policy_client import PolicyClient, PolicyClientConfig
from broker.policy_server import PolicyServerConfig
from broker.registry import Heartbeats, PolicyRegistry
from broker.relay import Relay
from broker.signing import load_signer
from broker.streams import connect, run_async
from policy import manifest as mf

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.faults]

RELAY = ["rollout.relay=true", "rollout.relay_timeout_s=4"]
LIVE = re.compile(r"policy v(\d+) live \((\d+) bytes.*\((?:[^()]*), from (\S+), \d+ stream\(s\)")


def live_lines(run: Run, worker: str) -> list[tuple[int, str]]:
    """(version, source) of each "policy vN live" line of a worker's log."""
    return [(int(m[1]), m[3]) for m in LIVE.finditer(run.log_tail(worker, 10_000_000))]


def relay_address(run: Run, worker: str) -> str:
    m = re.search(r"relay for peers on \S+ \(advertised (\S+)\)", run.log_tail(worker, 10_000_000))
    return m[1] if m else ""


def wait_for(cond, what: str, run: Run, timeout_s: float = 180.0, poll_s: float = 0.1) -> None:
    t0 = time.monotonic()
    while not cond():
        for name, p in [("trainer", run.trainer), *run.workers.items()]:
            assert p is None or p.poll() in (None, 0), f"{name} exited {p.returncode}:\n{run.log_tail(name)}"
        assert time.monotonic() - t0 < timeout_s, f"timed out waiting for {what}"
        time.sleep(poll_s)


def until_trained_by(run: Run, worker: str, after_step: int) -> None:
    wait_for(lambda: any(s > after_step for s in trained_by(run.run_dir, worker)), f"{worker} training again", run)


def trained_under_live_versions(run: Run) -> None:
    rows = lines(run.run_dir / "audit.jsonl")
    live = {w: {v for v, _ in live_lines(run, w)} for w in {g[2] for r in rows for g in r["groups"]}}
    for row in rows:
        for group_id, version, worker, *_ in row["groups"]:  # then the oldest token's version
            assert version in live[worker], f"{group_id}: v{version} was never live on {worker}"


def stop_trainer(run: Run) -> int:
    run.trainer.send_signal(signal.SIGTERM)
    assert run.wait_trainer() == 0, run.log_tail("trainer")
    return run.steps()


def latest_pointer(url: str, run_id: str, secret: Path):
    async def main():
        r = connect(url)
        try:
            return await PolicyRegistry(r, Keys(run_id=run_id), load_signer(str(secret))).latest()
        finally:
            await r.aclose()

    return run_async(main())


def test_a_relay_sigkilled_mid_transfer(tmp_path, redis_url, run_id, free_port):
    """w1 relays through a proxy (its advertised address); the proxy stalls w2's next fetch from it
    halfway, then w1 is SIGKILLed: w2's fetch from the dead relay fails within relay_timeout_s and
    w2 fetches from the trainer and keeps training."""
    port = free_port()
    proxy = Proxy(("127.0.0.1", port)).start()
    cfg = config(tmp_path, run_id, redis_url, max_steps=1000, relay_fanout=1, policy_deltas=False)
    run = Run(tmp_path, cfg)
    try:
        run.start_trainer()
        run.start_worker("w1", *RELAY, f"rollout.relay_port={port}", f"rollout.relay_advertise={proxy.address}")
        run.start_worker("w2", *RELAY)
        wait_for(lambda: any(s == proxy.address for _, s in live_lines(run, "w2")), "w2 fetching from w1", run)
        until_trained_by(run, "w2", 0)
        pointer = latest_pointer(redis_url, run_id, tmp_path / "run.secret")
        token = load_signer(str(tmp_path / "run.secret")).policy_token()
        with PolicyClient(PolicyClientConfig(address=proxy.address, run_token=token)) as c:
            m = c.get_manifest()
        assert pointer is not None and pointer.relays[0] == ("w1", proxy.address)
        proxy.stall_after(len(mf.manifest_to_bytes(m)) + m.total_bytes // 2)  # w2's next fetch, mid-stream
        wait_for(lambda: proxy.stalled_connections > 0, "a fetch from w1 stalled mid-transfer", run)
        run.kill(run.workers.pop("w1"))  # (popped: no longer a process the waits watch)
        step = run.steps()
        before = len(live_lines(run, "w2"))
        trainer_address = pointer.address
        wait_for(lambda: any(s == trainer_address for _, s in live_lines(run, "w2")[before:]), "w2 fell back", run)
        until_trained_by(run, "w2", step)
        steps = stop_trainer(run)
    finally:
        run.close()
        proxy.close()
    log = run.log_tail("w2", 10_000_000)
    assert re.search(rf"relay {re.escape(proxy.address)} failed for v\d+: .*relay fallback\)", log), log[-3000:]
    audit(run.run_dir, steps, stopped=True)
    trained_under_live_versions(run)


class RogueRelay:
    """A relay that heartbeats as worker "w0" (the head of the chain, by worker id) and serves each
    newest version with one byte of one tensor flipped; the manifest it serves is the real one."""

    def __init__(self, url: str, run_id: str, secret: Path):
        self.url, self.keys, self.signer = url, Keys(run_id=run_id), load_signer(str(secret))
        self.relay = Relay(PolicyServerConfig(keep_versions=2, run_token=self.signer.policy_token()))
        self.stop = threading.Event()
        self.offered = 0
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def start(self) -> RogueRelay:
        self.relay.start()
        self.thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.relay.stop()

    async def _main(self) -> None:
        r = connect(self.url)
        registry, beats = PolicyRegistry(r, self.keys, self.signer), Heartbeats(r, self.keys)
        try:
            while not self.stop.is_set():
                await beats.beat("w0", ttl_s=3.0, role="rollout", info={"relay": self.relay.address})
                p = await registry.latest()
                if p is not None and p.version > max(self.relay.server.versions(), default=0):
                    try:
                        await asyncio.to_thread(self._offer_flipped, p)
                    except grpc.RpcError:  # the trainer slow under load, or gone at the end: next round
                        pass
                await asyncio.sleep(0.1)
            await beats.remove("w0")
        finally:
            await r.aclose()

    def _offer_flipped(self, pointer) -> None:
        config = PolicyClientConfig(address=pointer.address, run_token=self.signer.policy_token())
        with PolicyClient(config) as c:
            fetched = c.fetch(pointer.version, digest=pointer.content_digest)
        data = dict(fetched.data)
        name = max(data, key=lambda n: len(data[n]))
        data[name] = np.array(data[name], copy=True)
        data[name][len(data[name]) // 2] ^= 0x01
        self.offered += self.relay.offer(fetched.manifest, data)


def _refused(run: Run, rogue: RogueRelay) -> list[str]:
    """w1's log lines refusing the rogue relay's bytes (one per version)."""
    log = run.log_tail("w1", 10_000_000)
    return re.findall(rf"relay {re.escape(rogue.relay.address)} failed for v\d+: ChecksumMismatch.*not asked", log)


def test_a_relay_serving_flipped_bytes_is_refused_and_fallen_back_from(tmp_path, redis_url, run_id):
    """A rogue relay at the head of the chain (w0 < w1 < w2): w1 (fetching in a child process) asks it
    first, w2 asks w1 first. Its bytes fail their chunk checksums: refused, counted, that relay not
    asked for that version again, the version fetched from the next source; nothing from it goes live."""
    cfg = config(tmp_path, run_id, redis_url, max_steps=1000, relay_fanout=1)
    run = Run(tmp_path, cfg)
    rogue = RogueRelay(redis_url, run_id, tmp_path / "run.secret")
    try:
        rogue.start()
        run.start_trainer()
        run.start_worker("w1", *RELAY, "rollout.fetch_process=true", "rollout.fetch_processes=1")  # in a child
        run.start_worker("w2", *RELAY)
        wait_for(lambda: rogue.offered >= 3, "the rogue relay serving three versions", run)
        # Three versions w1 asked the rogue for (under load w1 may skip a version a newer one superseded).
        wait_for(lambda: len(_refused(run, rogue)) >= 3, "w1 refusing the rogue's bytes three times", run)
        step = run.steps()
        until_trained_by(run, "w1", step)
        until_trained_by(run, "w2", step)
        pointer = latest_pointer(redis_url, run_id, tmp_path / "run.secret")
        steps = stop_trainer(run)
    finally:
        run.close()
        rogue.close()
    assert pointer.relays[0] == ("w0", rogue.relay.address)
    # w1 asks the rogue first, every version it fetches: refused by its chunk checksums in w1's fetch child.
    log = run.log_tail("w1", 10_000_000)
    assert len(_refused(run, rogue)) >= 3, log[-3000:]
    assert re.search(r"policy_sources_distrusted|relay fallback", log)
    for w in ("w1", "w2"):  # nothing from the rogue went live (w2 is served by w1 first)
        assert live_lines(run, w) and all(s != rogue.relay.address for _, s in live_lines(run, w)), w
    assert rogue.relay.server.stats()["bytes_sent"] > 0  # it was asked, and served its bytes
    audit(run.run_dir, steps, stopped=True)
    trained_under_live_versions(run)


def test_the_trainer_restarted_while_a_relay_holds_old_versions(tmp_path, redis_url, run_id):
    """w2 is stopped (SIGSTOP) behind w1; the trainer is SIGKILLed past its checkpoint and restarted
    while w1's relay still serves the lost steps' versions. The restart numbers its versions above
    any in Redis (a number never names two policies), so w1's old versions are never what a pointer
    names: w2, resumed, is served only the restarted trainer's versions (through w1 or from the
    trainer), converges and trains; w1 moves on to them too."""
    cfg = config(tmp_path, run_id, redis_url, max_steps=1000, relay_fanout=1, checkpoint_every=6)
    run = Run(tmp_path, cfg)
    secret = tmp_path / "run.secret"
    token = load_signer(str(secret)).policy_token()
    try:
        run.start_trainer()
        run.start_worker("w1", *RELAY)
        run.start_worker("w2", *RELAY)
        run.wait_steps(6)  # the checkpoint at step 6
        until_trained_by(run, "w2", 0)
        run.workers["w2"].send_signal(signal.SIGSTOP)
        run.wait_steps(9)  # w1 alone, versions past the checkpoint's
        run.kill(run.trainer)
        w1 = relay_address(run, "w1")
        with PolicyClient(PolicyClientConfig(address=w1, run_token=token)) as c:
            old = c.get_manifest()  # the newest version w1's relay serves: lost with the trainer
        run.start_trainer()

        def renumbered() -> bool:  # w2 resumes once the pointer names the restart's versions only
            p = latest_pointer(redis_url, run_id, secret)
            return p is not None and p.version > old.version

        wait_for(renumbered, "the restarted trainer's first version", run)
        before = len(live_lines(run, "w2"))
        run.workers["w2"].send_signal(signal.SIGCONT)
        wait_for(lambda: any(v > old.version for v, _ in live_lines(run, "w2")), "w2 past the old versions", run)
        wait_for(lambda: any(v > old.version for v, _ in live_lines(run, "w1")), "w1 past its old versions", run)
        pointer = latest_pointer(redis_url, run_id, secret)
        step = run.steps()
        until_trained_by(run, "w2", step)
        steps = stop_trainer(run)
    finally:
        for p in run.workers.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
        run.close()
    assert "resumed from" in run.log_tail("trainer", 10_000_000)
    assert pointer.version > old.version and pointer.content_digest != mf.manifest_digest(old).hex()
    # w2 went live only on versions the restarted trainer numbered (above the old ones) once resumed.
    after = live_lines(run, "w2")[before:]
    assert after and all(v > old.version for v, _ in after), after
    audit(run.run_dir, steps, stopped=True)
    trained_under_live_versions(run)

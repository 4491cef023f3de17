"""Trajectories and the policy pointer are signed with the run secret
(broker.signing); the trainer's stream dead-letters and counts unsigned or badly signed entries,
and a registry with a signer refuses a pointer written by anyone without the secret."""

from __future__ import annotations

import numpy as np
import pytest

from broker.codec import Trajectory, encode_trajectory
from broker.keys import Keys
from broker.registry import PolicyPointer, PolicyRegistry
from broker.signing import SECRET_ENV, TRAJECTORY, Signer, load_signer, policy_token, write_secret_file
from broker.streams import DATA_FIELD, SIG_FIELD, TrajectoryStream, connect, read_deadletter

pytestmark = pytest.mark.integration

SIGNER = Signer(b"k" * 32)


def _traj(i: int) -> Trajectory:
    return Trajectory(
        sample_id=f"g/{i}", prompt_id="g", group_id="g", sample_index=i, group_size=4,
        prompt_tokens=np.array([1, 2], dtype=np.int32), completion_tokens=np.array([3], dtype=np.int32),
        behavior_logprobs=np.array([-0.5], dtype=np.float32), reward=1.0, policy_version=1,
        contract_fingerprint="f" * 64, worker_id="w", created_at=0.0,
    )  # fmt: skip


async def test_trainer_stream_refuses_unsigned_and_forged_entries(redis_url, run_id):
    keys = Keys(run_id=run_id)
    async with connect(redis_url) as r:
        trainer = TrajectoryStream(r, keys, consumer="trainer", signer=SIGNER)
        await trainer.setup()
        await TrajectoryStream(r, keys, signer=SIGNER).add([_traj(0)])  # a worker with the secret
        await TrajectoryStream(r, keys).add([_traj(1)])  # anyone who can write Redis
        payload = encode_trajectory(_traj(2))
        await r.xadd(keys.trajectories, {DATA_FIELD: payload, SIG_FIELD: Signer(b"x" * 32).sign(TRAJECTORY, payload)})
        tampered = encode_trajectory(_traj(3))
        await r.xadd(keys.trajectories, {DATA_FIELD: tampered, SIG_FIELD: SIGNER.sign(TRAJECTORY, payload)})
        got = await trainer.read(block_ms=10)
        assert [rec.trajectory.sample_id for rec in got] == ["g/0"]
        assert trainer.counters.unsigned == 3
        reasons = [d.reason for d in await read_deadletter(r, keys)]
        assert reasons[0].startswith("unsigned") and all(x.startswith("bad signature") for x in reasons[1:])
        assert len(reasons) == 3


async def test_registry_refuses_pointers_without_the_secret(redis_url, run_id):
    keys = Keys(run_id=run_id)
    async with connect(redis_url) as r:
        trainer = PolicyRegistry(r, keys, signer=SIGNER)
        worker = PolicyRegistry(r, keys, signer=SIGNER)
        d = "d" * 64  # the content digest (policy.manifest.manifest_digest): signed with the rest
        await trainer.publish(
            PolicyPointer(version=3, address="10.0.0.1:50051", contract_fingerprint="f" * 64, content_digest=d)
        )
        assert (await worker.latest()).address == "10.0.0.1:50051" and worker.refused == 0
        # Redirect every worker to another server: without the secret the pointer no longer verifies.
        await r.hset(keys.policy_latest, "address", "evil.example:50051")
        assert await worker.latest() is None and worker.refused == 1
        await PolicyRegistry(r, keys).publish(PolicyPointer(version=4, address="evil:1", contract_fingerprint="f" * 64))
        assert await worker.latest() is None and worker.refused == 2  # unsigned
        await trainer.publish(
            PolicyPointer(version=5, address="10.0.0.1:50051", contract_fingerprint="f" * 64, content_digest=d)
        )
        assert (await worker.latest()).version == 5
        # Signed, but naming no content: it authenticates nothing a server sends, so it is refused.
        await trainer.publish(PolicyPointer(version=6, address="10.0.0.1:50051", contract_fingerprint="f" * 64))
        assert await worker.latest() is None and worker.refused == 3


def test_the_secret_comes_from_a_file_or_the_environment(tmp_path):
    path = write_secret_file(tmp_path / "run.secret")
    assert path.stat().st_mode & 0o777 == 0o600
    a = load_signer(str(path), environ={})
    assert a.verify(TRAJECTORY, b"x", load_signer("", environ={SECRET_ENV: path.read_text()}).sign(TRAJECTORY, b"x"))
    assert load_signer("", environ={}) is None
    with pytest.raises(ValueError, match="does not exist"):
        load_signer(str(tmp_path / "missing"), environ={})
    (tmp_path / "short").write_text("abcd")
    with pytest.raises(ValueError, match="2 bytes, want at least 16"):
        load_signer(str(tmp_path / "short"), environ={})


def test_the_policy_token_is_the_runs_and_reveals_no_tag_of_another_kind(tmp_path):
    a = load_signer(str(write_secret_file(tmp_path / "a.secret")), environ={})
    b = load_signer(str(write_secret_file(tmp_path / "b.secret")), environ={})
    token = policy_token(a)
    assert len(token) == 64 and token == a.policy_token() and token != policy_token(b)
    assert bytes.fromhex(token) != a.sign(TRAJECTORY, b"")  # its own domain: not an empty trajectory's tag
    assert policy_token(None) == ""  # no secret: no token, the client is unauthenticated

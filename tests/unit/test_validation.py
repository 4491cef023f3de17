"""trainer.validation.check_trajectory, by hand-made cases: each malformed sample a
broken or compromised worker could send, and each rule, one field wrong at a time; a good sample passes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from broker.codec import Trajectory
from trainer.validation import TrajectoryRules, check_trajectory

RULES = TrajectoryRules(group_size=4, vocab_size=16, max_seq_len=12, max_completion_tokens=3, max_abs_reward=10.0)
PROMPT = np.array([1, 4, 5, 3], dtype=np.int32)


def good(**changes) -> Trajectory:
    t = Trajectory(
        sample_id="p7/2", prompt_id="p7", group_id="p7", sample_index=2, group_size=4,
        prompt_tokens=PROMPT.copy(), completion_tokens=np.array([6, 2], dtype=np.int32),
        behavior_logprobs=np.array([-0.5, -0.0], dtype=np.float32), reward=1.0, policy_version=3,
        contract_fingerprint="f" * 64, worker_id="w0", created_at=0.0,
    )  # fmt: skip
    if "token_versions" not in changes and {"completion_tokens", "policy_version"} & set(changes):
        changes["token_versions"] = None  # all at the new policy_version, one per new token
    return dataclasses.replace(t, **changes)


def check(t: Trajectory, version: int = 3, fed=PROMPT) -> str | None:
    return check_trajectory(t, RULES, version=version, fed_prompt=fed)


def test_a_good_sample_passes():
    assert check(good()) is None
    assert check(good(token_versions=np.array([2, 3]))) is None  # spanning two versions (in-flight updates)
    assert check(good(reward=-10.0, completion_tokens=np.array([15, 0, 2], dtype=np.int32),
                      behavior_logprobs=np.array([-1000.0, -1.0, 0.0], dtype=np.float32))) is None  # fmt: skip


@pytest.mark.parametrize(
    "changes, version, fed, reason",
    [
        # malformed samples a broken or compromised worker could send
        (dict(group_size=1, sample_index=0, sample_id="p7/0"), 3, PROMPT, "group_size=1, the run's is 4"),
        (
            dict(completion_tokens=np.array([6, 16], dtype=np.int32)),
            3,
            PROMPT,
            "token ids in [6, 16], vocab is [0, 16)",
        ),
        (dict(reward=1e300), 3, PROMPT, "reward=1e+300"),
        (
            dict(
                completion_tokens=np.arange(2000, dtype=np.int32) % 16,
                behavior_logprobs=np.full(2000, -1.0, np.float32),
            ),
            3,
            PROMPT,
            "2000 completion tokens (want 1..3)",
        ),
        # one rule at a time
        (dict(sample_id="p8/2"), 3, PROMPT, "does not name group 'p7' slot 2"),
        (dict(sample_id="p7/1"), 3, PROMPT, "does not name group 'p7' slot 2"),
        ({}, 3, None, "no prompt this trainer fed"),
        (dict(prompt_tokens=np.array([1, 4, 5, 4], dtype=np.int32)), 3, PROMPT, "differ from the prompt fed"),
        (dict(prompt_tokens=np.array([1, 4, 5], dtype=np.int32)), 3, PROMPT, "differ from the prompt fed"),
        (
            dict(completion_tokens=np.array([], dtype=np.int32), behavior_logprobs=np.array([], np.float32)),
            3,
            PROMPT,
            "0 completion tokens",
        ),
        (dict(behavior_logprobs=np.array([-0.5, 0.25], dtype=np.float32)), 3, PROMPT, "behavior log-probs in"),
        (dict(behavior_logprobs=np.array([-0.5, -1e4], dtype=np.float32)), 3, PROMPT, "behavior log-probs in"),
        (dict(reward=-10.5), 3, PROMPT, "reward=-10.5"),
        (dict(policy_version=4), 3, PROMPT, "policy_version=4 (want 1..3"),
        (dict(policy_version=0), 3, PROMPT, "policy_version=0"),
        (dict(token_versions=np.array([0, 3])), 3, PROMPT, "token_versions from 0 (want >= 1)"),
    ],
)
def test_each_bad_field_is_named(changes, version, fed, reason):
    got = check(good(**changes), version, fed)
    assert got is not None and reason in got, got


def test_too_long_for_the_context():
    rules = dataclasses.replace(RULES, max_seq_len=5)
    assert "4+2 tokens > max_seq_len=5" in check_trajectory(good(), rules, version=3, fed_prompt=PROMPT)


def test_rules_are_validated():
    with pytest.raises(ValueError, match=r"group_size=0 .*max_abs_reward=inf"):
        TrajectoryRules(group_size=0, vocab_size=1, max_seq_len=1, max_completion_tokens=1, max_abs_reward=float("inf"))

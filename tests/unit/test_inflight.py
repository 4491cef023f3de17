"""In-flight weight updates (loop.inflight_updates) in the batcher, on the CPU engine and on the
PackedEngine's CPU reference path: a version installed in place between two steps, rows continuing
on their KV. Every token records the version whose weights computed its logits; on the CPU engine
the behavior log-probs equal a teacher-forced replay of that path (each token's logits from its own
version, earlier KV kept), and the tokens on KV of an older version differ from a fresh forward."""

from __future__ import annotations

import pytest
import torch

from policy import qat
from policy.model import KVCache, ModelConfig, Transformer
from policy.recipe import Recipe
from rollout.batching import ContinuousBatcher, ModelBackend, PackedBackend, stale_kv_tokens, token_versions
from rollout.engine import decode_one_token, forced_logprobs, generate, prefill
from rollout.packed_engine import EngineConfig, PackedEngine

TINY = ModelConfig.preset("tiny")
SMALL = ModelConfig.preset("tiny", n_layers=2, n_experts=4)


def sharp(seed: int) -> Transformer:
    m = Transformer(TINY, seed=seed).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(40.0)  # not near-uniform
    return m


@torch.no_grad()
def replay(models: dict, prompt: list[int], tokens: list[int], versions: list[int]) -> list[float]:
    """The CPU engine's path teacher-forced: the prompt prefilled under versions[0] (token 0's
    logits); token t's logits from decoding token t-1 under versions[t], on the KV kept so far."""
    m0 = models[versions[0]]
    cache = KVCache(m0.cfg, 1, len(prompt) + len(tokens), dtype=m0.lm_head.weight.dtype)
    logits = prefill(m0, torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.bool), cache)
    out = []
    for t, tok in enumerate(tokens):
        if t:
            logits = decode_one_token(
                models[versions[t]], torch.tensor([tokens[t - 1]]), torch.ones(1, dtype=torch.bool), cache
            )
        out.append(float(logits.log_softmax(dim=-1)[0, tok]))
    return out


def test_token_versions_and_stale_kv_rules_by_hand():
    assert token_versions([(0, 3)], 4) == [3, 3, 3, 3]
    assert token_versions([(0, 3), (1, 3), (4, 5)], 6) == [3, 3, 3, 3, 5, 5]
    assert token_versions([(0, 3), (1, 4), (2, 6), (2, 7)], 4) == [3, 4, 7, 7]  # same start: the later wins
    assert token_versions([(0, 3), (1, 4), (9, 5)], 3) == [3, 4, 4]  # a segment past the end: none of its tokens
    assert stale_kv_tokens([3, 3, 4, 5]) == 2 and stale_kv_tokens([2, 2]) == 0 and stale_kv_tokens([]) == 0


def test_cpu_in_flight_swap_records_each_tokens_version_and_keeps_the_kv():
    v1, v2 = sharp(1), sharp(2)
    live = sharp(1)  # the worker's one model, updated in place
    b = ContinuousBatcher(
        ModelBackend(live, slots=2, temperature=1.0, stop=set(), pad_id=0), max_inflight_groups=3, version=1
    )
    b.submit("a", [1, 2, 3], [11, 12, 13], max_new_tokens=8)  # 3 samples, 2 slots: one waits on the prefix
    done = []
    for _ in range(3):
        done += b.step()
    live.load_state_dict(v2.state_dict())
    b.swap(2, inflight=True)  # rows live: no drain
    assert b.version == 2 and not b.drained
    b.submit("b", [4, 5], [21], max_new_tokens=6)
    done += b.run()
    out = {r.key: r for r in done}
    a, bb = out["a"], out["b"]
    # Rows running at the swap: 3 tokens sampled, the 4th's logits already computed under v1.
    assert a.versions[0] == a.versions[1] == [1] * 4 + [2] * 4
    assert a.versions[2] == [1] + [2] * 7  # admitted after the swap: its first token from v1's prefix
    assert bb.versions[0] == [2] * 6 and a.version == 1 and bb.version == 2
    models = {1: v1, 2: v2}
    for i in range(3):
        want = replay(models, [1, 2, 3], a.tokens[i], a.versions[i])
        torch.testing.assert_close(torch.tensor(a.logprobs[i]), torch.tensor(want), rtol=2e-5, atol=2e-5)
    ref1 = generate(v1, [[1, 2, 3]], n_samples=3, max_new_tokens=8, seeds=[11, 12, 13]).completions()
    assert a.tokens[0][:4] == ref1[0][:4] and a.tokens[1][:4] == ref1[1][:4]  # v1's tokens are v1's samples
    assert bb.tokens == generate(v2, [[4, 5]], max_new_tokens=6, seeds=[21]).completions()
    # The KV is kept: the v2 tokens of a sample begun under v1 are not what a fresh v2 forward gives.
    assert [stale_kv_tokens(v) for v in a.versions] == [4, 4, 7]
    fresh = forced_logprobs(v2, [[1, 2, 3]], [a.tokens[0]])[0, 4:]
    assert float((fresh - torch.tensor(a.logprobs[0][4:])).abs().max()) > 1e-3


def test_an_in_flight_swap_refuses_a_new_backend_while_rows_live():
    live = sharp(1)
    b = ContinuousBatcher(
        ModelBackend(live, slots=2, temperature=1.0, stop=set(), pad_id=0), max_inflight_groups=1, version=1
    )
    b.submit("a", [1, 2], [1], max_new_tokens=4)
    b.step()
    with pytest.raises(ValueError, match="no new backend"):
        b.swap(2, ModelBackend(sharp(2), slots=2, temperature=1.0, stop=set(), pad_id=0), inflight=True)


def _packed(seed: int):
    model = Transformer(SMALL, seed=seed)
    plan = Recipe.load("bf16").plan(model)
    return plan, qat.quantize_weights(model, plan)


def _engine(seed: int) -> PackedEngine:
    plan, packed = _packed(seed)
    return PackedEngine(
        SMALL, plan, packed, device="cpu", dtype=torch.float32, engine=EngineConfig(max_batch=4, max_seq_len=32)
    )


def test_packed_engine_in_flight_update_records_the_boundary_where_the_engine_samples_anew():
    eng = _engine(1)
    b = ContinuousBatcher(
        PackedBackend(eng, temperature=1.0, stop=set(), pad_id=0, check_every=2), max_inflight_groups=2, version=1
    )
    b.submit("a", [1, 2, 3], [11, 12], max_new_tokens=10)
    done = b.step() + b.step()  # admission samples token 0, each step decodes 2: 5 tokens per row
    assert eng.update(_packed(2)[1])  # in place, rows live
    b.swap(2, inflight=True)
    b.submit("b", [4, 5], [21], max_new_tokens=6)
    out = {r.key: r for r in done + b.run()}
    a = out["a"]
    assert a.versions == [[1] * 5 + [2] * 5] * 2
    ref1 = _engine(1).generate([[1, 2, 3]], n_samples=2, max_new_tokens=10, temperature=1.0, seeds=[11, 12])
    assert [t[:5] for t in a.tokens] == [t[:5] for t in ref1.completions()]
    ref2 = _engine(2).generate([[4, 5]], max_new_tokens=6, temperature=1.0, seeds=[21])
    assert out["b"].tokens == ref2.completions() and out["b"].versions == [[2] * 6]

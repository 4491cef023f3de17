"""rollout.engine: batch-invariant, per-row seeded generation; behavior log-probs are the sampling
policy's; a prompt group is prefilled once and shared by its samples."""

from __future__ import annotations

import pytest
import torch

from policy.model import KVCache, ModelConfig, Transformer
from rollout.engine import decode_one_token, generate, prefill, sample

TINY = ModelConfig.preset("tiny")


@pytest.fixture(scope="module")
def model() -> Transformer:
    m = Transformer(TINY, seed=1).eval()
    # Sharpen the output distribution so sampling and log-prob checks are not all near-uniform.
    with torch.no_grad():
        m.lm_head.weight.mul_(40.0)
    return m


def test_generation_independent_of_padding_and_batch(model):
    prompts = [[1, 2, 3], [7] * 9, [4, 5], [9, 8, 7, 6, 5]]
    seeds = [11, 22, 33, 44]
    batch = generate(model, prompts, max_new_tokens=12, temperature=1.0, seeds=seeds)
    for b in (0, 2):
        alone = generate(model, [prompts[b]], max_new_tokens=12, temperature=1.0, seeds=[seeds[b]])
        assert alone.tokens[0].tolist() == batch.tokens[b].tolist()
        torch.testing.assert_close(alone.logprobs[0], batch.logprobs[b], rtol=2e-5, atol=2e-5)
    # Reordering the batch moves rows, not results.
    rev = generate(model, prompts[::-1], max_new_tokens=12, temperature=1.0, seeds=seeds[::-1])
    assert rev.tokens.flip(0).tolist() == batch.tokens.tolist()
    # Different seeds give different samples (the test can fail if seeding were ignored).
    other = generate(model, prompts, max_new_tokens=12, temperature=1.0, seeds=[1, 2, 3, 4])
    assert other.tokens.tolist() != batch.tokens.tolist()


def test_generation_seeded_by_generator_is_reproducible(model):
    a = generate(model, [[1, 2], [3]], max_new_tokens=8, generator=torch.Generator().manual_seed(7))
    b = generate(model, [[1, 2], [3]], max_new_tokens=8, generator=torch.Generator().manual_seed(7))
    assert a.tokens.tolist() == b.tokens.tolist() and torch.equal(a.logprobs, b.logprobs)


def test_generation_logprobs_are_the_sampling_policy(model):
    """Behavior log-probs equal the full forward's log_softmax(logits / T) of the sampled tokens."""
    prompts = [[5, 6, 7], [1]]
    for temp in (1.0, 0.6, 0.0):
        gen = generate(model, prompts, max_new_tokens=7, temperature=temp, seeds=[3, 4])
        for b, p in enumerate(prompts):
            seq = torch.tensor(p + gen.tokens[b].tolist())
            with torch.no_grad():
                lp = model.token_logprobs(seq[None, :-1], seq[None, 1:], temperature=temp or 1.0)[0]
            torch.testing.assert_close(gen.logprobs[b], lp[len(p) - 1 :], rtol=2e-5, atol=2e-5)
            if temp == 0.0:
                with torch.no_grad():
                    greedy = model(seq[None, :-1])[0, len(p) - 1 :].argmax(-1)
                assert greedy.tolist() == gen.tokens[b].tolist()


@pytest.mark.slow
def test_sampling_follows_the_distribution(model):
    """Empirical first-token frequencies over many seeds match softmax(logits / T)."""
    n, temp = 3000, 0.8
    gen = generate(model, [[3, 1, 4]] * n, max_new_tokens=1, temperature=temp, seeds=range(n))
    with torch.no_grad():
        probs = (model(torch.tensor([[3, 1, 4]]))[0, -1] / temp).softmax(-1)
    freq = torch.bincount(gen.tokens[:, 0], minlength=TINY.vocab_size).double() / n
    top = probs.topk(5).indices
    assert probs[top[0]] > 0.05  # the sharpened head makes this a real check
    tol = 4 * (probs[top].double() * (1 - probs[top].double()) / n).sqrt() + 1e-3
    assert ((freq[top] - probs[top].double()).abs() <= tol).all(), (freq[top], probs[top])
    assert abs(gen.logprobs[:, 0].exp().mean().item() - (probs**2).sum().item()) < 0.02


def test_generation_stops_at_eos_and_pads(model):
    free = generate(model, [[2, 3], [4]], max_new_tokens=10, temperature=0.0)
    eos = free.tokens[0, 2].item()  # greedy: row 0 will produce this token at step 2
    out = generate(model, [[2, 3], [4]], max_new_tokens=10, temperature=0.0, eos_id=eos, pad_id=0)
    n0 = out.lengths[0].item()
    assert n0 == 1 + free.tokens[0, :3].tolist().index(eos) and out.stopped[0]
    assert out.tokens[0, n0 - 1] == eos and (out.tokens[0, n0:] == 0).all() and (out.logprobs[0, n0:] == 0).all()
    assert out.tokens[0, :n0].tolist() == free.tokens[0, :n0].tolist()
    assert out.completions()[0] == out.tokens[0, :n0].tolist()
    if eos not in free.tokens[1].tolist():
        assert out.lengths[1] == 10 and not out.stopped[1]
        assert out.tokens[1].tolist() == free.tokens[1].tolist()


def test_generate_rejects_bad_input(model):
    with pytest.raises(ValueError, match="empty prompt"):
        generate(model, [[1], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(model, [[1]], max_new_tokens=TINY.max_seq_len)
    with pytest.raises(ValueError, match="vocab"):
        generate(model, [[1, TINY.vocab_size]], max_new_tokens=2)
    with pytest.raises(ValueError, match="seeds has 1"):
        generate(model, [[1], [2]], max_new_tokens=2, seeds=[1])


def test_n_samples_share_one_prefill_and_keep_per_row_seeds(model):
    """generate([p], n_samples=n) == generate([p] * n): rows are prompt-major, each row its own seed."""
    prompts, n = [[1, 2, 3], [7, 7, 7, 7, 7]], 3
    seeds = [5, 6, 7, 8, 9, 10]
    shared = generate(model, prompts, n_samples=n, max_new_tokens=10, seeds=seeds)
    copied = generate(model, [p for p in prompts for _ in range(n)], max_new_tokens=10, seeds=seeds)
    assert shared.tokens.shape == (6, 10)
    assert shared.tokens.tolist() == copied.tokens.tolist()
    torch.testing.assert_close(shared.logprobs, copied.logprobs, rtol=2e-5, atol=2e-5)
    assert len({tuple(r) for r in shared.tokens[:n].tolist()}) > 1  # the seeds differ, so do the samples
    with pytest.raises(ValueError, match="seeds has 3 entries for 6 rows"):
        generate(model, prompts, n_samples=n, max_new_tokens=2, seeds=[1, 2, 3])
    with pytest.raises(ValueError, match="n_samples=0"):
        generate(model, prompts, n_samples=0, max_new_tokens=2)


def test_prefill_decode_sample_compose_to_generate(model):
    """The three steps, called by hand at temperature 0, reproduce generate's greedy tokens."""
    prompt = [4, 5, 6]
    cache = KVCache(TINY, 1, 8)
    logits = prefill(model, torch.tensor([prompt]), torch.ones(1, 3, dtype=torch.bool), cache)
    toks = []
    for _ in range(4):
        nxt, _ = sample(logits, 0.0, None)
        toks.append(int(nxt[0]))
        logits = decode_one_token(model, nxt, torch.ones(1, dtype=torch.bool), cache)
    assert toks == generate(model, [prompt], max_new_tokens=4, temperature=0.0).tokens[0].tolist()


@pytest.mark.parametrize("recipe", [None, "nvfp4_moe"])
@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped"])
def test_teacher_forced_logprobs_equal_the_kv_cache_decode(recipe, grouped):
    """What the trainer learns (the teacher-forced forward on right-padded packed rows) is what
    generation computes (left-padded prefill, then one token at a time with the KV cache), on the MoE's
    loop and on its grouped GEMM, with experts that get no token in a decode step (32 experts, top-4,
    8 rows): log-probs equal up to accumulation order; and generate's behavior log-probs are those."""
    from policy import qat
    from policy.model import MoE
    from policy.recipe import Recipe
    from rollout.engine import forced_logprobs
    from trainer.sequences import pack

    cfg = ModelConfig.preset("tiny", n_experts=32, top_k=4, shared_expert_ffn_dim=0)
    m = Transformer(cfg, seed=2).eval()
    for mod in m.modules():
        if isinstance(mod, MoE):
            mod.grouped = grouped
    if recipe is not None:
        qat.apply_qat(m, Recipe.load(recipe))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (4, 11, 7, 9, 5, 12, 6, 8)]
    answers = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 1, 6, 2, 5, 4, 2, 6)]
    decoded = forced_logprobs(m, prompts, answers)
    tokens, targets, attn, mask = pack(prompts, answers, 0)
    with torch.no_grad():
        lp = m.token_logprobs(tokens, targets, attention_mask=attn)
    for b, a in enumerate(answers):
        teacher = lp[b][mask[b] > 0]
        assert teacher.shape == (len(a),)
        torch.testing.assert_close(decoded[b, : len(a)], teacher, rtol=0, atol=2e-5)
        assert not decoded[b, len(a) :].any()
    assert decoded[:, 0].std() > 0.1  # the log-probs vary: a comparison that can fail
    gen = generate(m, prompts, max_new_tokens=5, temperature=0.0)
    greedy = forced_logprobs(m, prompts, gen.tokens.tolist())
    torch.testing.assert_close(greedy, gen.logprobs, rtol=0, atol=2e-5)

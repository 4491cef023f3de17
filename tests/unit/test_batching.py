"""rollout.batching: continuous batching on the CPU engine and on the PackedEngine (CPU reference path).

A sample's tokens depend only on its prompt and seed, never on when it joined the batch or who
shares it: every group generated under continuous batching (rows joining as others finish, groups
split over slots, varied lengths, stop tokens) equals the same group generated alone by the static
engine. Prefixes are freed at their last reader, versions swap only when drained, and requests
that cannot fit are refused with one clear line."""

from __future__ import annotations

import functools

import pytest
import torch

from policy import qat
from policy.model import ModelConfig, Transformer
from policy.recipe import Recipe
from rollout import sampling
from rollout.batching import ContinuousBatcher, ModelBackend, PackedBackend
from rollout.engine import generate
from rollout.packed_engine import EngineConfig, PackedEngine

TINY = ModelConfig.preset("tiny")
SMALL = ModelConfig.preset("tiny", n_layers=2, n_experts=4)

# (prompt, samples, max_new_tokens): more samples than slots, different lengths and budgets.
GROUPS = [
    ([1, 2, 3], 3, 9),
    ([7] * 9, 2, 5),
    ([4, 5], 4, 12),
    ([9, 8, 7, 6, 5], 1, 3),
    ([11, 12, 13, 14], 3, 7),
    ([3, 1], 2, 10),
]


def seeds_of(g: int, n: int) -> list[int]:
    return [1000 * g + i for i in range(n)]


@functools.cache
def sharp(seed: int) -> Transformer:
    m = Transformer(TINY, seed=seed).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(40.0)  # not near-uniform: stop tokens and ties matter
    return m


class Recording:
    """A backend wrapper that records how many rows were live at each admission."""

    def __init__(self, backend):
        self.inner, self.live_at_admit = backend, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def admit(self, prefix, slots, seeds, max_new):
        self.live_at_admit.append(self.inner.live)
        self.inner.admit(prefix, slots, seeds, max_new)


def run_groups(backend, groups, *, max_inflight: int, version: int = 1) -> dict:
    rec = Recording(backend)
    b = ContinuousBatcher(rec, max_inflight_groups=max_inflight, version=version)
    todo, out = list(enumerate(groups)), {}
    while todo or not b.idle:
        while todo and b.can_submit():
            g, (prompt, n, m) = todo.pop(0)
            b.submit(g, prompt, seeds_of(g, n), max_new_tokens=m)
        for r in b.step():
            out[r.key] = r
    assert not b.prefixes and backend.live == 0
    assert any(live > 0 for live in rec.live_at_admit), "no row ever joined a running batch"
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_cpu_engine_continuous_equals_each_group_alone(temperature):
    model = sharp(1)
    free = generate(model, [GROUPS[2][0]], max_new_tokens=6, temperature=0.0)
    eos = int(free.tokens[0, 3])  # a token the model does produce: some rows stop early
    backend = ModelBackend(model, slots=4, temperature=temperature, stop={eos}, pad_id=0)
    out = run_groups(backend, GROUPS, max_inflight=3)
    assert sorted(out) == list(range(len(GROUPS)))
    stopped_early = 0
    for g, (prompt, n, m) in enumerate(GROUPS):
        ref = generate(model, [prompt], n_samples=n, max_new_tokens=m, temperature=temperature,
                       seeds=seeds_of(g, n), eos_id=eos)  # fmt: skip
        r = out[g]
        assert r.version == 1 and len(r.tokens) == n
        assert r.tokens == ref.completions(), g
        for a, b in zip(r.logprobs, ref.completion_logprobs()):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=2e-5, atol=2e-5)
        assert r.stopped == ref.stopped.tolist()
        stopped_early += sum(r.stopped)
    assert stopped_early > 0  # the stop path was exercised


@functools.cache
def _packed(recipe: str):
    model = Transformer(SMALL, seed=1)
    plan = Recipe.load(recipe).plan(model)
    return plan, qat.quantize_weights(model, plan)


def _engine(recipe: str, max_batch: int = 4) -> PackedEngine:
    plan, packed = _packed(recipe)
    return PackedEngine(
        SMALL, plan, packed, device="cpu", dtype=torch.float32, engine=EngineConfig(max_batch=max_batch, max_seq_len=32)
    )


@pytest.mark.parametrize("recipe", ["bf16", "int4_qat"])
def test_packed_engine_continuous_equals_each_group_alone(recipe):
    eng = _engine(recipe)
    free = eng.generate([GROUPS[0][0]], max_new_tokens=6, temperature=0.0)
    eos = int(free.tokens[0, 2])
    backend = PackedBackend(eng, temperature=1.0, stop={eos}, pad_id=0, check_every=2)
    out = run_groups(backend, GROUPS, max_inflight=4)
    ref_eng = _engine(recipe, max_batch=8)
    for g, (prompt, n, m) in enumerate(GROUPS):
        ref = ref_eng.generate([prompt], n_samples=n, max_new_tokens=m, temperature=1.0, seeds=seeds_of(g, n),
                               eos_id=eos)  # fmt: skip
        assert out[g].tokens == ref.completions(), g
        assert out[g].stopped == ref.stopped.tolist()
        for a, b in zip(out[g].logprobs, ref.completion_logprobs()):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-5)


def test_sampler_counter_is_the_rows_own_token_index():
    """Rows at different token indices in one call draw what each draws alone at its index."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=g) * 3
    seeds = torch.tensor([3, 1 << 40, 7, 7, 12345])
    steps = torch.tensor([0, 4, 9, 2, 31])
    tok, lp = sampling.sample(logits, seeds, steps, 1.0)
    for r in range(5):
        t1, l1 = sampling.sample(logits[r : r + 1], seeds[r : r + 1], int(steps[r]), 1.0)
        assert int(tok[r]) == int(t1[0]) and float(lp[r]) == float(l1[0])
    assert not torch.equal(sampling.sample(logits, seeds, steps + 1, 1.0)[0], tok)  # the index matters


def test_prefix_is_held_for_waiting_samples_and_freed_at_the_last_admission():
    model = sharp(1)
    backend = ModelBackend(model, slots=2, temperature=1.0, stop=set(), pad_id=0)
    b = ContinuousBatcher(backend, max_inflight_groups=2, version=1)
    b.submit("a", [1, 2, 3], [1, 2, 3, 4, 5], max_new_tokens=3)
    b.submit("b", [4, 5], [6], max_new_tokens=2)
    refs = []
    while not b.idle:
        b.step()
        refs.append((b.sched.prefix_refs("a"), "a" in b.prefixes))
    # 5 samples through 2 slots: the prefix is held (refs = samples still waiting) until the 5th is admitted.
    assert refs[0] == (3, True)
    assert all(held == (n > 0) for n, held in refs)
    assert refs[-1] == (0, False) and not b.prefixes
    alone = generate(model, [[1, 2, 3]], n_samples=5, max_new_tokens=3, seeds=[1, 2, 3, 4, 5])
    b.submit("a", [1, 2, 3], [1, 2, 3, 4, 5], max_new_tokens=3)
    assert b.run()[0].tokens == alone.completions()


def test_versions_swap_only_when_drained_and_every_group_carries_its_version():
    v1, v2 = sharp(1), sharp(2)
    b = ContinuousBatcher(
        ModelBackend(v1, slots=2, temperature=1.0, stop=set(), pad_id=0), max_inflight_groups=3, version=1
    )
    b.submit("a", [1, 2, 3], [1, 2, 3], max_new_tokens=6)  # 3 samples, 2 slots: one waits
    b.submit("b", [4, 5], [4], max_new_tokens=6)
    done = b.step()
    b.request_swap()
    with pytest.raises(ValueError, match="swap to v2 refused"):
        b.swap(2, ModelBackend(v2, slots=2, temperature=1.0, stop=set(), pad_id=0))
    while not b.drained:
        done += b.step()
    assert [r.key for r in done] == ["a"] and done[0].version == 1  # b never started under v1
    b.swap(2, ModelBackend(v2, slots=2, temperature=1.0, stop=set(), pad_id=0))
    b.submit("c", [4, 5], [4], max_new_tokens=6)
    rest = {r.key: r for r in b.run()}
    assert rest["b"].version == 2 and rest["c"].version == 2
    assert done[0].tokens == generate(v1, [[1, 2, 3]], n_samples=3, max_new_tokens=6, seeds=[1, 2, 3]).completions()
    want_v2 = generate(v2, [[4, 5]], max_new_tokens=6, seeds=[4]).completions()
    assert rest["b"].tokens == want_v2 and rest["c"].tokens == want_v2
    assert want_v2 != generate(v1, [[4, 5]], max_new_tokens=6, seeds=[4]).completions()  # the swap mattered


def test_capacity_errors_are_one_clear_line():
    model = sharp(1)
    b = ContinuousBatcher(
        ModelBackend(model, slots=2, temperature=1.0, stop=set(), pad_id=0), max_inflight_groups=1, version=1
    )
    with pytest.raises(ValueError, match=r"max_seq_len"):
        b.submit("x", [1] * TINY.max_seq_len, [1], max_new_tokens=1)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        b.submit("x", [1], [1], max_new_tokens=0)
    b.submit("a", [1], [1], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_inflight_groups=1"):
        b.submit("b", [1], [1], max_new_tokens=2)
    eng = _engine("bf16")
    pb = ContinuousBatcher(PackedBackend(eng, temperature=1.0, stop=set(), pad_id=0), max_inflight_groups=1, version=1)
    with pytest.raises(ValueError, match="KV capacity max_seq_len=32 per slot"):
        pb.submit("x", [1] * 30, [1], max_new_tokens=3)


@pytest.mark.parametrize("engine", ["cpu", "packed"])
def test_per_sample_budgets(engine):
    """max_new_tokens per sample: each sample stops at its own budget, as if generated alone with it."""
    budgets, seeds, prompt = [2, 7, 4], [5, 6, 7], [1, 2, 3]
    if engine == "cpu":
        model = sharp(1)
        backend = ModelBackend(model, slots=2, temperature=1.0, stop=set(), pad_id=0)
        alone = [
            generate(model, [prompt], max_new_tokens=m, seeds=[s]).completions()[0] for m, s in zip(budgets, seeds)
        ]
    else:
        eng = _engine("bf16", max_batch=2)
        backend = PackedBackend(eng, temperature=1.0, stop=set(), pad_id=0, check_every=3)
        ref = _engine("bf16")
        alone = [ref.generate([prompt], max_new_tokens=m, seeds=[s]).completions()[0] for m, s in zip(budgets, seeds)]
    b = ContinuousBatcher(backend, max_inflight_groups=1, version=1)
    b.submit("a", prompt, seeds, max_new_tokens=budgets)
    (r,) = b.run()
    assert [len(t) for t in r.tokens] == budgets and r.tokens == alone
    with pytest.raises(ValueError, match=r"max_new_tokens=\[1, 0\] for 2 samples"):
        b.submit("b", prompt, [1, 2], max_new_tokens=[1, 0])


def test_max_inflight_groups_is_validated():
    from rollout.config import RolloutConfig

    assert RolloutConfig().max_inflight_groups == 1  # today's configs: one group at a time
    with pytest.raises(ValueError, match="max_inflight_groups=0"):
        RolloutConfig(max_inflight_groups=0)

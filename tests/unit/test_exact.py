"""policy.exact's ops are batch-invariant bit for bit (a row alone equals the same row inside batches
of any size, at any position, under any padding or KV capacity) and close to the ordinary ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from policy import exact
from policy.model import ModelConfig, QuantHook, Transformer, causal_mask
from rollout.engine import forced_logprobs
from trainer.sequences import pack


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _in_batches(fn, row: torch.Tensor, sizes=(1, 7, 64)) -> None:
    """fn(row[None]) equals fn(batch)[i] for row placed at every position i of batches of `sizes`."""
    g = torch.Generator().manual_seed(1)
    alone = fn(row[None])[0]
    for n in sizes:
        for i in sorted({0, n // 2, n - 1}):
            batch = torch.randn(n, *row.shape, generator=g) * 3
            batch[i] = row
            assert torch.equal(fn(batch)[i], alone), (n, i)


def test_tree_sum_order_and_trailing_zeros():
    e = 2.0**-24
    x = torch.tensor([1.0, e, 0.0, e, 0.0])
    # P = 8: ((x0 + x4) + (x2 + 0)) + ((x1 + 0) + (x3 + 0)) = 1 + 2e = 1 + 2^-23, while a left-to-right
    # fp32 sum gives 1 (1 + e rounds to 1, ties to even)
    assert exact.tree_sum(x).item() == 1.0 + 2.0**-23
    assert torch.tensor(1.0) + e + 0.0 + e + 0.0 == 1.0
    for extra in (1, 3, 11, 100):  # masked keys / padding appended as zeros: the same bits
        assert torch.equal(exact.tree_sum(torch.cat([x, torch.zeros(extra)])), exact.tree_sum(x))
    y = torch.randn(37, 129)
    assert _rel(exact.tree_sum(y), y.sum(-1)) < 1e-5
    assert torch.equal(exact.tree_sum(y, 0), exact.tree_sum(y.t().contiguous(), 1))


@pytest.mark.parametrize(("K", "N"), [(128, 512), (96, 33)])
def test_mm_row_alone_equals_the_row_in_any_batch(K, N):
    g = torch.Generator().manual_seed(0)
    w, row = torch.randn(N, K, generator=g), torch.randn(K, generator=g)
    _in_batches(lambda x: exact.mm(x, w), row, sizes=(1, 7, 64, 300))  # 300 rows: several chunks
    x = torch.randn(50, K, generator=g)
    assert _rel(exact.mm(x, w), F.linear(x, w)) < 1e-5


def test_chunking_does_not_change_the_bits(monkeypatch):
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(40, 64, generator=g), torch.randn(300, 64, generator=g)
    q, k, v = _qkv(2, 4, 2, 11, 16)
    mask = causal_mask(torch.ones(2, 11, dtype=torch.bool), 0)
    whole = exact.mm(x, w), exact.attention(q, k, v, mask)
    monkeypatch.setitem(exact._CHUNKS, "cpu", 1 << 10)  # chunks over rows, columns, batch rows and queries
    assert torch.equal(exact.mm(x, w), whole[0]) and torch.equal(exact.attention(q, k, v, mask), whole[1])


def test_rowwise_ops_are_batch_invariant_and_close():
    g = torch.Generator().manual_seed(2)
    row, w = torch.randn(512, generator=g) * 4, torch.rand(512, generator=g) + 0.5
    _in_batches(lambda x: exact.rms_norm(x, w, 1e-6), row)
    _in_batches(exact.softmax, row)
    _in_batches(exact.log_softmax, row)
    _in_batches(exact.silu, row)
    x = torch.randn(33, 512, generator=g) * 4
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    assert _rel(exact.rms_norm(x, w, 1e-6), ref) < 1e-5
    assert _rel(exact.softmax(x), x.softmax(-1)) < 1e-5
    assert _rel(exact.log_softmax(x), x.log_softmax(-1)) < 1e-5
    assert _rel(exact.silu(x), F.silu(x)) < 1e-5


def test_pointwise_kernels_do_not_depend_on_where_a_value_sits():
    """The premise of exact mode's exp, log, sin and cos (torch's CPU kernels): a value's result is
    the same alone, at any offset of a longer tensor, and read through a strided view."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4099, generator=g) * 6
    for fn, v in ((torch.exp, x), (torch.log, x.abs() + 1e-3), (torch.cos, x * 50), (torch.sin, x * 50)):
        whole = fn(v)
        assert torch.equal(fn(torch.stack([v, v], -1)[:, 0]), whole)
        for n, off in ((1, 0), (3, 5), (17, 100), (1000, 7)):
            assert torch.equal(fn(v[off : off + n].clone()), whole[off : off + n])


def _qkv(B, H, Hkv, T, hd, seed=4):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, hd, generator=g), torch.randn(B, Hkv, T, hd, generator=g),
            torch.randn(B, Hkv, T, hd, generator=g))  # fmt: skip


def test_attention_is_the_same_for_a_full_causal_batch_and_a_gapped_kv_cache():
    q, k, v = _qkv(3, 4, 2, 9, 32)
    full = exact.attention(q, k, v, causal_mask(torch.ones(3, 9, dtype=torch.bool), 0))  # the trainer's T x T
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert _rel(full, ref) < 1e-5
    # The engine: query t of row 1 alone, its keys 0..t in a cache of capacity 16 with invalid slots
    # (left padding, gaps) between them, in a batch with other rows.
    for t in (0, 4, 8):
        slots = torch.tensor([2, 3, 5, 6, 7, 9, 10, 12, 13])[: t + 1]
        kc, vc = torch.randn(2, 2, 16, 32), torch.randn(2, 2, 16, 32)
        valid = torch.zeros(2, 16, dtype=torch.bool)
        kc[0, :, slots], vc[0, :, slots], valid[0, slots] = k[1, :, : t + 1], v[1, :, : t + 1], True
        valid[1, :5] = True
        mask = causal_mask(valid, int(slots[-1]))[:, :, :1, : int(slots[-1]) + 1]
        out = exact.attention(q[1:2, :, t : t + 1].expand(2, -1, -1, -1), kc[:, :, : int(slots[-1]) + 1],
                              vc[:, :, : int(slots[-1]) + 1], mask)  # fmt: skip
        assert torch.equal(out[0, :, 0], full[1, :, t]), t


def test_exact_ops_backward_is_the_ordinary_gradient():
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(6, 64, generator=g, requires_grad=True), torch.randn(32, 64, generator=g, requires_grad=True)
    (exact.mm(x, w) ** 2).sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    (F.linear(x, w) ** 2).sum().backward()
    assert _rel(gx, x.grad) < 1e-5 and _rel(gw, w.grad) < 1e-5


@pytest.mark.parametrize("preset", ["tiny", "tiny-dense"])
def test_exact_model_decode_with_a_kv_cache_equals_the_full_forward(preset):
    """A plain model in exact mode (QuantHook(exact=True)): the engine's left-padded prefill and
    KV-cache decode give the full forward's log-probs (right-padded rows) bit for bit."""
    model = Transformer(ModelConfig.preset(preset, n_layers=2), seed=3)
    model.quant_hook = QuantHook(exact=True)
    assert model.exact
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15]]
    completions = [[20, 21, 22, 23, 24], [25, 26], [27, 28, 29, 30, 31, 32, 33, 34]]
    with torch.no_grad():
        engine = forced_logprobs(model, prompts, completions)
        tokens, targets, attn, mask = pack(prompts, completions, 0)
        trainer = model.token_logprobs(tokens, targets, attention_mask=attn)
    for b, c in enumerate(completions):
        assert torch.equal(trainer[b][mask[b] > 0], engine[b, : len(c)]), b


def test_exact_ops_do_not_depend_on_the_thread_count():
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(300, 512, generator=g) * 4, torch.randn(256, 512, generator=g)
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append((exact.log_softmax(x), exact.silu(x), exact.mm(x, w), torch.exp(x)))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*outs))

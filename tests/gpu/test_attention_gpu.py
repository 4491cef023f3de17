"""The policy model's masked attention on a GPU computes causal attention over each row's real tokens,
in training (grad on) as at evaluation: SDPA's default backend against its math kernel in fp32 on the
same bf16 inputs, at Qwen3-30B-A3B's attention widths (32 query / 4 KV heads of 128), right-padded
rows of unequal length, the mask `Transformer.forward` builds (`causal_mask`). Each backend's error
is printed (`-s`; on the H200 with torch 2.11 the default is cuDNN's kernel: max error 0.0093 vs
0.0078 for the math kernel in bf16; the memory-efficient kernel takes no GQA with this mask). And the whole model: token log-probs with grad on equal those
under no_grad, and a change to a later token leaves earlier log-probs alone (no look-ahead).
Runs on the device machine only (bench/run_e2e_device.sh, bench/run_trainer_device.sh)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from policy.model import ModelConfig, Transformer, causal_mask  # noqa: E402

B, T, H, HK, HD = 8, 45, 32, 4, 128
LENS = [45, 40, 33, 21, 17, 9, 5, 2]


def _inputs():
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, H, T, HD, device="cuda", generator=g).bfloat16()
    k = torch.randn(B, HK, T, HD, device="cuda", generator=g).bfloat16()
    v = torch.randn(B, HK, T, HD, device="cuda", generator=g).bfloat16()
    valid = torch.arange(T, device="cuda")[None, :] < torch.tensor(LENS, device="cuda")[:, None]
    return q, k, v, valid


def _reference(q, k, v, valid):
    """fp32 math-kernel attention: query t of row b sees keys s <= t that are real tokens."""
    mask = causal_mask(valid, 0)
    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)


def _real(o, valid):
    return o.transpose(1, 2)[valid]  # [real tokens, H, HD]: padded queries' outputs are unused


@pytest.mark.parametrize("grad", [False, True])
def test_sdpa_backends_on_the_models_mask(grad):
    """Which SDPA backends compute the masked attention right (printed); the default, which the model uses, must."""
    q, k, v, valid = _inputs()
    ref = _real(_reference(q, k, v, valid), valid)
    mask = causal_mask(valid, 0)
    errors = {}
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH, None):
        qq, kk, vv = (t.clone().requires_grad_(grad) for t in (q, k, v))
        try:
            with torch.set_grad_enabled(grad), sdpa_kernel([backend]) if backend else contextlib.nullcontext():
                o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, enable_gqa=True)
        except RuntimeError as e:
            errors[str(backend)] = f"not available ({str(e).splitlines()[0][:60]})"
            continue
        errors[str(backend or "default")] = float((_real(o, valid).float() - ref).abs().max())
    print(f"\nSDPA on the model's mask, grad={grad}: max |error| vs fp32 math per backend: {errors}")
    assert errors["default"] < 0.05  # bf16 rounding of the output


def test_model_logprobs_same_with_grad_and_no_lookahead():
    cfg = ModelConfig.preset("qwen3-30b-a3b", n_layers=2, dim=512, n_experts=16, top_k=4, expert_ffn_dim=256)
    with torch.device("cuda"):
        model = Transformer(cfg, seed=0)
    g = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, 1000, (B, T), device="cuda", generator=g)
    valid = torch.arange(T, device="cuda")[None, :] < torch.tensor(LENS, device="cuda")[:, None]
    targets = tokens.roll(-1, dims=1)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        with torch.no_grad():
            lp0 = model.token_logprobs(tokens, targets, attention_mask=valid)
        lp1 = model.token_logprobs(tokens, targets, attention_mask=valid)
        lp1.sum().backward()
        changed = tokens.clone()
        changed[:, 1:] = (changed[:, 1:] + 7) % 1000  # every token after the first
        with torch.no_grad():
            lp2 = model.token_logprobs(changed, targets, attention_mask=valid)
    assert float((lp0 - lp1.detach())[valid].abs().max()) < 0.05
    # position 0 sees only token 0: its log-prob of targets[:, 0] must not move
    assert float((lp0[:, 0] - lp2[:, 0]).abs().max()) < 0.05

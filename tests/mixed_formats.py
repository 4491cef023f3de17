"""Shared by the manifest and policy-transport tests: which format each tensor of the tiny model
gets, so one policy mixes every format (TP-friendly: no 128x128 blocks on 128-wide tensors)."""

from __future__ import annotations


def format_for(name: str) -> tuple[str, dict]:
    if ".experts." in name:
        return "nvfp4", {"scope": "tensor"}
    if "o_proj" in name:
        return "mxfp8", {}
    if "q_proj" in name:
        return "int4", {"group_size": 32}
    if "lm_head" in name:
        return "fp8_block", {"block": (128, 128)}
    if "shared_expert.down" in name:
        return "fp8_block", {"block": (1, 64)}
    return "bf16", {}

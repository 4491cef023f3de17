"""MoE routing metadata for the grouped 4-bit matmul, in plain torch (any device, no Triton).

`moe_align` groups the (token, slot) pairs of a top-k routing by expert into BLOCK_M-row
blocks, the layout `matmul_triton.moe_w4a16_matmul` launches over. On CUDA at decode sizes
`matmul_triton.moe_align_fast` computes the same arrays in one small Triton program (this
version is ~10 small torch kernels, ~50 us on the H200); this one is the reference the GPU
test compares it with, and the fallback for large batches.
"""

from __future__ import annotations

import torch

BLOCK_M = 16  # token rows per block: the narrow side of the kernel's tensor-core tile


def moe_align(topk_ids: torch.Tensor, num_experts: int):
    """Group (token, slot) pairs by expert into BLOCK_M-row blocks, on the device, no host sync.

    Returns (pair index per block row, -1 for padding [max_blocks * BLOCK_M], expert per block
    [max_blocks], number of used blocks [1]). max_blocks is a bound known from shapes alone, so
    the launch grid is fixed and CUDA-graph friendly; programs past the used blocks exit.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    p = flat.numel()
    dev = flat.device
    max_blocks = min(p, num_experts) + p // BLOCK_M
    # scatter_add, not bincount: bincount syncs with the host, which breaks CUDA-graph capture.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    blocks_per = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = torch.cumsum(blocks_per, 0)
    block_start = block_end - blocks_per
    order = torch.sort(flat, stable=True).indices
    sorted_e = flat[order]
    first = torch.cumsum(counts, 0) - counts
    rank = torch.arange(p, device=dev) - first[sorted_e]
    slot = block_start[sorted_e] * BLOCK_M + rank
    pairs = torch.full((max_blocks * BLOCK_M,), -1, dtype=torch.int32, device=dev)
    pairs[slot] = order.to(torch.int32)
    block_ids = torch.arange(max_blocks, device=dev)
    block_expert = torch.searchsorted(block_end, block_ids, right=True).clamp(max=num_experts - 1).to(torch.int32)
    num_blocks = block_end[-1:].to(torch.int32)
    return pairs, block_expert, num_blocks, max_blocks

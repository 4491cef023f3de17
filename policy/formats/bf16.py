"""BF16: the identity format (round to bfloat16, nearest even). Kept as a format so recipes,
manifests and transport treat every parameter the same way."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._common import Operand, check_input, check_shape


@dataclass(frozen=True)
class BF16Tensor:
    values: torch.Tensor  # bfloat16 [M, K]
    shape: tuple[int, int]

    def parts(self) -> dict[str, torch.Tensor]:
        return {"values": self.values}


def block_shape(**params) -> tuple[int, int]:
    """(rows, cols) of one quantization block: every element alone."""
    return 1, 1


def quantize(x: torch.Tensor) -> BF16Tensor:
    xf = check_input(x, 1, "bf16.quantize")
    return BF16Tensor(xf.to(torch.bfloat16), tuple(xf.shape))


def dequantize(q: BF16Tensor) -> torch.Tensor:
    return q.values.to(torch.float32)


def operand(q: BF16Tensor) -> Operand:
    """The Compute contract's operand: the bf16 values themselves."""
    return Operand(q.values)


def fake_quant(x: torch.Tensor) -> torch.Tensor:
    return dequantize(quantize(x)).to(x.dtype)


def from_parts(parts: dict[str, torch.Tensor], shape) -> BF16Tensor:
    m, k = (int(s) for s in shape)
    return BF16Tensor(check_shape("values", parts["values"], (m, k), torch.bfloat16), (m, k))

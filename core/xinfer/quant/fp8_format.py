"""FP8 e4m3 weights kept packed: each row of a weight [..., N, K] stored as ``K / 128`` blocks of
132 bytes, a float32 scale then 128 e4m3 codes, the values being ``code * scale``.

Checkpoints scale FP8 weights per tensor, per row or per 128 x 128 tile (DeepSeek V3/R1, Qwen3-FP8,
MiniMax-M2, GLM-4.x-FP8); each of those is this layout once every 128 consecutive values of a row
share one scale, the scale copied into each of its rows' blocks at load: the same values, for 4
bytes per 128 (3.1 % more than the checkpoint). ``--isq fp8`` quantizes each block to its own scale.
"""

from __future__ import annotations

import torch
from torch import Tensor

from xinfer.quant.tensor import WeightFormat, divide

E4M3_MAX = 448.0
BLOCK = 128


class Fp8Format(WeightFormat):
    name = "fp8"
    block_values = BLOCK
    block_bytes = 4 + BLOCK

    def dequantize(self, raw: Tensor) -> Tensor:
        blocks = raw.reshape(*raw.shape[:-1], -1, self.block_bytes)
        scales = blocks[..., :4].contiguous().view(torch.float32)
        codes = blocks[..., 4:].contiguous().view(torch.float8_e4m3fn).float()
        return (codes * scales).flatten(-2)

    def quantize(self, values: Tensor) -> Tensor:
        blocks = values.float().reshape(*values.shape[:-1], -1, BLOCK)
        scales = divide(blocks.abs().amax(-1, keepdim=True).clamp_min(1e-12), E4M3_MAX)
        return pack(blocks.div(scales).to(torch.float8_e4m3fn).flatten(-2), scales.squeeze(-1))


def pack(codes: Tensor, scales: Tensor) -> Tensor:
    """``codes`` e4m3 [..., K] and one float32 scale per 128 of them, [..., K / 128] -> the format's bytes."""
    blocks = codes.reshape(*codes.shape[:-1], -1, BLOCK).view(torch.uint8)
    scale_bytes = scales.float().contiguous().unsqueeze(-1).view(torch.uint8)
    return torch.cat([scale_bytes, blocks], dim=-1).flatten(-2)

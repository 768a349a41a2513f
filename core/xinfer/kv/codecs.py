"""How one side of the cache (K or V) stores a vector of ``head_dim`` values.

A codec names the tensors it keeps per (token, KV head) and their trailing shapes,
and turns vectors [..., D] into those tensors and back. Formats pair a K codec
with a V codec.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from xinfer.kv import codes

# Lloyd–Max levels for a unit Gaussian (optimal MSE quantizer); positive half, ascending.
GAUSSIAN_LEVELS = {
    8: (0.2451, 0.7560, 1.3439, 2.1520),
    16: (0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326),
}


@dataclass(frozen=True)
class Field:
    suffix: str  # tensor name = side + suffix ("k", "k_scale", ...)
    trailing: tuple[int, ...]  # shape after [num_blocks, block_size, Hkv]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.trailing) * self.dtype.itemsize


class Codec:
    def fields(self, head_dim: int, dtype: torch.dtype) -> list[Field]:
        raise NotImplementedError

    def encode(self, x: Tensor, dtype: torch.dtype) -> list[Tensor]:
        """[..., D] -> one tensor per field, in field order."""
        raise NotImplementedError

    def decode(self, stored: list[Tensor]) -> Tensor:
        """Back to [..., D] in fp32."""
        raise NotImplementedError


class Plain(Codec):
    """The model dtype, unquantized."""

    def fields(self, head_dim, dtype):
        return [Field("", (head_dim,), dtype)]

    def encode(self, x, dtype):
        return [x.to(dtype)]

    def decode(self, stored):
        return stored[0].float()


class Fp8(Codec):
    """e4m3 with a per-(token, head) absmax scale: error <= |x|/16 + absmax * 2**-18."""

    def fields(self, head_dim, dtype):
        return [Field("", (head_dim,), torch.uint8), Field("_scale", (), torch.float32)]

    def encode(self, x, dtype):
        scale = codes.absmax(x)
        return [codes.fp8_encode(x, scale), scale]

    def decode(self, stored):
        return codes.fp8_decode(stored[0], stored[1])


@dataclass(frozen=True)
class Uniform(Codec):
    """``levels`` evenly spaced values over [-scale, scale], codes of ``bits`` each: 8 (one
    per byte), 4 (two per byte) or 3 (eight per three bytes). The scale is the vector's
    absmax (error <= absmax / (levels - 1)), or with ``rms_clip`` that many times its RMS:
    for rotated keys, nearly Gaussian, whose absmax grows with the head dim, a grid fitted
    to the RMS is finer and the rare coordinates beyond it saturate."""

    levels: int
    bits: int
    rms_clip: float | None = None

    @property
    def scales_by_rms(self) -> bool:
        return self.rms_clip is not None

    def fields(self, head_dim, dtype):
        return [Field("", (head_dim * self.bits // 8,), torch.uint8), Field("_scale", (), torch.float32)]

    def encode(self, x, dtype):
        scale = codes.rms(x) * self.rms_clip if self.scales_by_rms else codes.absmax(x)
        return [self._pack(codes.uniform_encode(x, scale, self.levels)), scale]

    def decode(self, stored):
        return codes.uniform_decode(self._unpack(stored[0]), stored[1], self.levels)

    def _pack(self, c: Tensor) -> Tensor:
        return PACKING[self.bits][0](c)

    def _unpack(self, packed: Tensor) -> Tensor:
        return PACKING[self.bits][1](packed)


PACKING = {8: (lambda c: c, lambda p: p), 4: (codes.pack4, codes.unpack4), 3: (codes.pack3, codes.unpack3)}


@dataclass(frozen=True)
class LloydMax(Uniform):
    """All ``2**bits`` levels placed for a Gaussian of the vector's RMS (rotated keys
    are close to Gaussian), instead of evenly over the absmax."""

    @property
    def scales_by_rms(self) -> bool:
        return True

    def encode(self, x, dtype):
        rms = codes.rms(x)
        levels = self._levels(x.device)
        bounds = (levels[1:] + levels[:-1]) / 2
        c = torch.bucketize(x.float() / rms.unsqueeze(-1), bounds).to(torch.uint8)
        return [self._pack(c), rms]

    def decode(self, stored):
        levels = self._levels(stored[0].device)
        return levels[self._unpack(stored[0]).long()] * stored[1].unsqueeze(-1)

    def _levels(self, device: torch.device) -> Tensor:
        half = torch.tensor(GAUSSIAN_LEVELS[self.levels])
        return torch.cat((-half.flip(0), half)).to(device)

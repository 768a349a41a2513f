"""GGUF weights laid out for the GPU at load: the same bytes as the file, in planes.

The file's blocks (34, 144, 210 bytes...) interleave scales with codes at unaligned offsets,
and keep a block's values in an order only a byte-by-byte decode follows. Here a weight
[N, K] is cut into tiles of ``32 * fields`` values of a row, and every tile's codes are 32
little-endian 32-bit words: field ``f`` of word ``w`` (``bits`` wide, from bit ``f * bits``)
is the code of the tile's column ``64 (f // 2) + 2 w + f % 2``. A kernel reads a row's codes as
whole 16-byte-aligned words, takes field ``f`` of each word with one mask (and a shift shared
by fields), and the activations of fields ``2p`` and ``2p + 1`` are the low and high halves of
32 consecutive 32-bit words of bf16 pairs, read alike. What a field's values share (Q8_0's and
Q4_0's block scale, Q4_K's sub-block scale and min) is one value per (row, tile, field, half
of the words) (Q6_K, whose sub-blocks are 16 values: per quarter).

The planes, each [N, tiles * bytes a tile] and one after the other in one uint8 buffer:

- codes: 32 words a tile (bits 8: Q8_0's int8 codes, plus 128 to make them unsigned; 4:
  nibbles); a 5th (Q5_0, Q5_1) or 5th and 6th (Q6_K) bit of each code in a ``high`` plane,
  one byte (Q5) or two (Q6_K) per word, field ``i`` at bit ``i`` (``2 i``).
- the block scales as the file stores them, in block order: Q8_0/Q4_0/Q5_0 ``d`` (f16 per
  block of 32), Q4_1/Q5_1 ``(d, m)``, Q4_K the 16 leading bytes of its block (``d``,
  ``dmin``, the 12 bytes of 6-bit scales and mins), Q6_K its 16 int8 scales then, in a plane
  of their own, its f16 ``d``.

:func:`to_planes` and :func:`from_planes` convert between the file's bytes and these, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from xinfer.quant.gguf_formats import _k_nibbles, _nibbles, _qh_bits, _shifted


@dataclass(frozen=True)
class PlaneLayout:
    """A GGUF type's planes: ``fields`` codes a word, ``high_bits`` of each code in the high
    plane (0: none), and the bytes a tile takes in each plane after the codes."""

    name: str
    qk: int  # values of the file's block
    nbytes: int  # bytes of the file's block
    fields: int
    high_bits: int
    plane_bytes: tuple[int, ...]  # a tile's bytes in each plane after the codes (and the high bits)

    @property
    def tile(self) -> int:
        return 32 * self.fields

    @property
    def blocks(self) -> int:
        """File blocks a tile."""
        return self.tile // self.qk

    def tile_bytes(self) -> tuple[int, ...]:
        high = (32 * self.high_bits * self.fields // 8,) if self.high_bits else ()
        return (128, *high, *self.plane_bytes)

    def fits(self, k: int) -> bool:
        return k > 0 and k % self.tile == 0


LAYOUTS: dict[str, PlaneLayout] = {
    p.name: p
    for p in (
        PlaneLayout("Q8_0", 32, 34, 4, 0, (8,)),
        PlaneLayout("Q4_0", 32, 18, 8, 0, (16,)),
        PlaneLayout("Q4_1", 32, 20, 8, 0, (32,)),
        PlaneLayout("Q5_0", 32, 22, 8, 1, (16,)),
        PlaneLayout("Q5_1", 32, 24, 8, 1, (32,)),
        PlaneLayout("Q4_K", 256, 144, 8, 0, (16,)),
        PlaneLayout("Q6_K", 256, 210, 8, 2, (16, 2)),
    )
}
assert all(sum(p.tile_bytes()) == p.blocks * p.nbytes for p in LAYOUTS.values())


def _pack_fields(codes: Tensor, bits: int) -> Tensor:
    """Codes [..., fields, 32] (each below ``2**bits``) -> [..., 32 * fields * bits / 8] bytes:
    word ``w``'s fields from its lowest bit, little-endian."""
    *outer, fields, words = codes.shape
    per_byte = 8 // bits
    grouped = codes.to(torch.uint8).reshape(*outer, fields // per_byte, per_byte, words)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)[:, None]
    packed = (grouped << shifts).sum(-2, dtype=torch.uint8)  # disjoint bits: the sum is their or
    return packed.transpose(-1, -2).flatten(-2)


def _unpack_fields(packed: Tensor, fields: int, bits: int) -> Tensor:
    """Inverse of :func:`_pack_fields`: [..., 32 * fields * bits / 8] -> [..., fields, 32]."""
    *outer, _ = packed.shape
    per_byte = 8 // bits
    grouped = packed.reshape(*outer, 32, fields // per_byte).transpose(-1, -2)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)[:, None]
    return ((grouped.unsqueeze(-2) >> shifts) & ((1 << bits) - 1)).reshape(*outer, fields, 32)


def _codes_and_scales(blocks: Tensor, name: str) -> tuple[Tensor, list[Tensor]]:
    """A tile's file blocks [R, blocks * nbytes] -> its codes in value order [R, fields, 32]
    (unsigned) and the bytes of its scale planes, each [R, bytes]."""
    rows = blocks.shape[0]
    if name == "Q8_0":
        b = blocks.reshape(rows, 4, 34)
        return b[..., 2:] ^ 0x80, [b[..., :2].flatten(1)]
    if name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        head = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 2, "Q5_1": 4}[name]
        b = blocks.reshape(rows, 8, -1)
        codes = _nibbles(b[..., -16:])
        if name.startswith("Q5"):
            codes = codes | (_qh_bits(b[..., head : head + 4]) << 4)
        return codes, [b[..., :head].flatten(1)]
    if name == "Q4_K":
        return _k_nibbles(blocks[:, 16:]), [blocks[:, :16]]
    assert name == "Q6_K", name
    # ql: byte l of half h holds values 128 h + l (low nibble) and 128 h + 64 + l (high);
    # qh: byte l of half h holds the top two bits of 128 h + 32 s + l at bit 2 s
    low = _nibbles(blocks[:, :128].reshape(rows, 2, 64)).reshape(rows, 256)
    high = _shifted(blocks[:, 128:192].reshape(rows, 2, 32), [0, 2, 4, 6], 3).reshape(rows, 256)
    codes = low | (high << 4)
    return codes.reshape(rows, 8, 32), [blocks[:, 192:208], blocks[:, 208:210]]


def _file_blocks(codes: Tensor, scales: list[Tensor], name: str) -> Tensor:
    """Inverse of :func:`_codes_and_scales`: [R, blocks * nbytes] bytes."""
    rows = codes.shape[0]
    if name == "Q8_0":
        return torch.cat([scales[0].reshape(rows, 4, 2), codes ^ 0x80], dim=-1).flatten(1)
    if name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        low = codes & 0xF
        nibbles = low[..., :16] | (low[..., 16:] << 4)
        parts = [scales[0].reshape(rows, 8, -1)]
        if name.startswith("Q5"):
            bits = ((codes >> 4) & 1).reshape(rows, 8, 4, 8)  # qh: bit j of the u32 is value j's
            parts.append((bits << torch.arange(8, dtype=torch.uint8, device=codes.device)).sum(-1, dtype=torch.uint8))
        return torch.cat([*parts, nibbles], dim=-1).flatten(1)
    if name == "Q4_K":
        chunks = codes.reshape(rows, 4, 2, 32)
        return torch.cat([scales[0], (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).flatten(1)], dim=-1)
    values = codes.reshape(rows, 2, 2, 64)  # half, which nibble, byte
    ql = (values[:, :, 0] & 0xF) | ((values[:, :, 1] & 0xF) << 4)
    high = (codes.reshape(rows, 2, 4, 32) >> 4) & 3  # half, shift, byte
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=codes.device)[:, None]
    qh = (high << shifts).sum(-2, dtype=torch.uint8)
    return torch.cat([ql.flatten(1), qh.flatten(1), *scales], dim=-1)


def plane_sizes(layout: PlaneLayout, n: int, k: int) -> list[int]:
    """Bytes of each plane of a weight [n, k]."""
    return [n * (k // layout.tile) * b for b in layout.tile_bytes()]


def planes(raw: Tensor, layout: PlaneLayout, n: int, k: int) -> list[Tensor]:
    """The planes of a weight [n, k] in ``raw`` (1-D uint8), each [n, tiles * bytes a tile]."""
    views, offset = [], 0
    for size in plane_sizes(layout, n, k):
        views.append(raw[offset : offset + size].view(n, -1))
        offset += size
    return views


def _fields(values: Tensor) -> Tensor:
    """A tile's codes in column order [R, 32 * fields] -> [R, fields, 32], field ``f`` of word ``w``
    the code of column ``64 (f // 2) + 2 w + f % 2``."""
    rows, tile = values.shape
    return values.reshape(rows, tile // 64, 32, 2).transpose(-1, -2).reshape(rows, tile // 32, 32)


def _columns(fields: Tensor) -> Tensor:
    """Inverse of :func:`_fields`."""
    rows, count, _ = fields.shape
    return fields.reshape(rows, count // 2, 2, 32).transpose(-1, -2).reshape(rows, count, 32)


def to_planes(packed: Tensor, layout: PlaneLayout, chunk_bytes: int = 1 << 26) -> Tensor:
    """The file's bytes [N, K / qk * nbytes] as planes (1-D, as many bytes), ``chunk_bytes`` of
    the file at a time (the unpacked codes take a few times the bytes they come from)."""
    n, row_bytes = packed.shape
    tiles = row_bytes // (layout.blocks * layout.nbytes)
    out = torch.empty(packed.numel(), dtype=torch.uint8, device=packed.device)
    views = planes(out, layout, n, tiles * layout.tile)
    step = max(1, chunk_bytes // max(row_bytes, 1))
    for start in range(0, n, step):
        rows = packed[start : start + step]
        codes, scales = _codes_and_scales(rows.reshape(-1, layout.blocks * layout.nbytes), layout.name)
        codes = _fields(codes.reshape(codes.shape[0], -1))
        made = [_pack_fields(codes & 0xF if layout.fields == 8 else codes, 32 // layout.fields)]
        if layout.high_bits:
            made.append(_pack_fields(codes >> 4, layout.high_bits))
        for view, plane in zip(views, made + scales, strict=True):
            view[start : start + step] = plane.reshape(rows.shape[0], -1)
    return out


def from_planes(raw: Tensor, layout: PlaneLayout, n: int, k: int) -> Tensor:
    """Inverse of :func:`to_planes`: the file's bytes [n, k / qk * nbytes]."""
    tiles = k // layout.tile
    views = [p.reshape(n * tiles, -1) for p in planes(raw, layout, n, k)]
    codes = _unpack_fields(views[0], layout.fields, 32 // layout.fields)
    if layout.high_bits:
        codes = codes | (_unpack_fields(views[1], layout.fields, layout.high_bits) << 4)
    scales = views[1 + bool(layout.high_bits) :]
    return _file_blocks(_columns(codes), scales, layout.name).reshape(n, -1)

"""Safetensors checkpoints stored quantized. Each quantized ``X.weight`` is stored as tensors under
``X``, read once all of them have come, and kept packed where a weight format holds the same values
(FP8 whose every 128 consecutive values of a row share a scale: :mod:`xinfer.quant.fp8_format`),
else decoded at load to the model's dtype (one log line counts each: a decoded weight takes a float
checkpoint's memory, and ``--isq`` packs it again):

- FP8 e4m3, ``X.weight`` beside its scale, the weight being ``fp8 * scale``: ``quant_method``
  ``"fp8"`` (DeepSeek V3/R1, Qwen3-FP8, MiniMax-M2, GLM-4.x-FP8) with ``X.weight_scale_inv``, one
  per ``weight_block_size`` block (128 x 128, the edge blocks partial); ``"fbgemm_fp8"`` and
  compressed-tensors' 8-bit float weights with ``X.weight_scale``, per tensor, row or block.
- compressed-tensors' ``pack-quantized`` integers (llm-compressor's W4A16 and W8A16):
  ``X.weight_packed`` int32 words holding ``num_bits``-bit values along each row (the low bits
  first, offset by ``2 ** (num_bits - 1)``), ``X.weight_shape``, ``X.weight_scale`` per row or per
  ``group_size`` columns, ``X.weight_zero_point`` (asymmetric; packed along the rows' groups) and
  ``X.weight_g_idx`` (activation order: each column's group); the weight is ``(q - zero) * scale``.

Activation scales (``input_scale``, ...) are not needed and are dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from xinfer.loading.stored import StoredTensor, Weights, whole
from xinfer.quant.fp8_format import BLOCK, Fp8Format, pack
from xinfer.quant.tensor import QuantizedTensor, get_weight_format

log = logging.getLogger("xinfer")

FP8_FORMAT = Fp8Format()
DROPPED = ("input_scale", "output_scale", "k_scale", "v_scale", "input_zero_point")


class Decoder:
    """How one quantization's tensors become the weight they stand for."""

    name: str
    parts: tuple[str, ...]  # the leaf names of a quantized weight's tensors (besides a plain ``weight``)

    def is_part(self, leaf: str, tensor: Tensor | StoredTensor) -> bool:
        return leaf in self.parts

    def complete(self, parts: Mapping[str, Tensor]) -> bool:
        raise NotImplementedError

    def decode(self, name: str, parts: Mapping[str, Tensor]) -> Tensor:
        """The weight ``name`` in fp32 from its ``parts``."""
        raise NotImplementedError

    def packed(self, name: str, parts: Mapping[str, Tensor]) -> QuantizedTensor | None:
        """The weight ``name`` kept packed, where a weight format holds its values exactly; else None."""
        return None


class Fp8(Decoder):
    name = "FP8"
    parts = ("weight_scale_inv", "weight_scale")

    def __init__(self, block: tuple[int, int] | None):
        self.block = block

    def is_part(self, leaf: str, tensor: Tensor | StoredTensor) -> bool:
        return leaf in self.parts or (leaf == "weight" and tensor.dtype == torch.float8_e4m3fn)

    def complete(self, parts: Mapping[str, Tensor]) -> bool:
        return "weight" in parts and any(p in parts for p in self.parts)

    def decode(self, name: str, parts: Mapping[str, Tensor]) -> Tensor:
        scale = parts.get("weight_scale_inv", parts.get("weight_scale"))
        assert scale is not None
        return scaled(parts["weight"], scale, name, self.block)

    def packed(self, name: str, parts: Mapping[str, Tensor]) -> QuantizedTensor | None:
        codes = parts["weight"]
        scale = parts.get("weight_scale_inv", parts.get("weight_scale"))
        assert scale is not None
        if codes.dim() != 2 or codes.dtype != torch.float8_e4m3fn or codes.shape[1] % BLOCK:
            return None
        rows, cols = codes.shape
        runs = scales_of((rows, cols), scale, name, self.block).reshape(rows, cols // BLOCK, BLOCK)
        first = runs[..., 0]
        if not torch.equal(first, runs.amax(-1)) or not torch.equal(first, runs.amin(-1)):
            return None  # blocks narrower than 128 columns: no one scale per packed block
        return QuantizedTensor(pack(codes, first), FP8_FORMAT, (rows, cols))


class PackedIntegers(Decoder):
    name = "packed integer"
    parts = ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_g_idx")

    def __init__(self, weights: Mapping[str, Any]):
        self.bits = int(weights["num_bits"])
        self.group = weights.get("group_size")
        self.required = {"weight_packed", "weight_shape", "weight_scale"}
        if not weights.get("symmetric", True):
            self.required.add("weight_zero_point")
        if weights.get("actorder") == "group":
            self.required.add("weight_g_idx")

    def complete(self, parts: Mapping[str, Tensor]) -> bool:
        return self.required <= parts.keys()

    def decode(self, name: str, parts: Mapping[str, Tensor]) -> Tensor:
        rows, cols = (int(n) for n in parts["weight_shape"].tolist())
        q = unpack_rows(parts["weight_packed"], self.bits, cols)
        scale = parts["weight_scale"].float()
        if scale.shape[0] != rows:
            raise ValueError(f"{name}: {scale.shape[0]} rows of scales for {rows} rows")
        zero = parts.get("weight_zero_point")
        zeros = unpack_rows(zero.T.contiguous(), self.bits, rows).T if zero is not None else torch.zeros_like(scale)
        group = parts.get("weight_g_idx")
        if group is None:
            group = (
                torch.arange(cols) // (self.group or cols)
                if scale.shape[1] > 1
                else torch.zeros(cols, dtype=torch.long)
            )
        group = group.long()
        if int(group.max()) >= scale.shape[1]:
            raise ValueError(f"{name}: {scale.shape[1]} groups of scales for {cols} columns")
        return (q.float() - zeros[:, group].float()) * scale[:, group]


def unpack_words(words: Tensor, bits: int) -> Tensor:
    """[R, W] int32 words of ``bits``-bit values, the low bits first, as [R, W * 32 / bits] values."""
    if 32 % bits:
        raise ValueError(f"{bits}-bit values do not pack whole into 32-bit words")
    shifts = torch.arange(32 // bits, dtype=torch.int64) * bits
    return ((words.to(torch.int64)[..., None] >> shifts) & ((1 << bits) - 1)).flatten(-2)


def unpack_rows(words: Tensor, bits: int, count: int) -> Tensor:
    """:func:`unpack_words`' first ``count`` values of each row, each offset by ``2 ** (bits - 1)``
    (compressed-tensors' signed values)."""
    values = unpack_words(words, bits)[..., :count]
    if values.shape[-1] != count:
        raise ValueError(f"{words.shape[-1]} words hold fewer than {count} {bits}-bit values")
    return values - (1 << (bits - 1))


AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # the nibble of its word holding each of 8 columns


class GroupedInt4(Decoder):
    """AutoGPTQ's and AutoAWQ's 4-bit weights with a scale and a zero point per ``group`` input columns:
    ``X.qweight``, ``X.qzeros`` (int32 words of 8 values, the low nibble first) and ``X.scales`` (fp16,
    [K / group, N]); the weight [N, K] is ``scale * (q - zero)``. GPTQ packs ``qweight`` [K / 8, N] along the
    input columns and stores each zero less one (its ``checkpoint_format`` ``gptq``; not ``gptq_v2``), with
    ``X.g_idx`` each input column's group (activation order, ``desc_act``, makes it a permutation). AWQ
    (``version`` ``gemm``) packs both ``qweight`` [K, N / 8] and ``qzeros`` along the output rows, its 8
    values a word in the order :data:`AWQ_ORDER` undoes.

    Kept packed as Q4_1 (``d * q + m``, blocks of 32: ``d`` the scale, ``m = -scale * zero`` rounded to
    fp16) where each block of 32 columns is in one group, else decoded at load."""

    name = "4-bit"

    def __init__(self, method: str, group: int, gptq_v1: bool):
        self.method, self.group, self.zero_offset = method, group, 1 if gptq_v1 else 0
        self.parts = ("qweight", "qzeros", "scales", "g_idx") if method == "gptq" else ("qweight", "qzeros", "scales")

    def complete(self, parts: Mapping[str, Tensor]) -> bool:
        return set(self.parts) <= parts.keys()

    def values(self, name: str, parts: Mapping[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """q [N, K], each column's group [K], the scales and zeros [groups, N]."""
        scales = parts["scales"].float()
        groups, rows = scales.shape
        if self.method == "gptq":
            q = unpack_words(parts["qweight"].T, 4)
            zeros = unpack_words(parts["qzeros"], 4) + self.zero_offset
            group = parts["g_idx"].long()
        else:
            q = awq_order(unpack_words(parts["qweight"], 4)).T
            zeros = awq_order(unpack_words(parts["qzeros"], 4))
            group = torch.arange(q.shape[1]) // self.group
        cols = q.shape[1]
        if q.shape[0] != rows or group.shape != (cols,) or zeros.shape != scales.shape or int(group.max()) >= groups:
            raise ValueError(
                f"{name}: {self.method} tensors of shapes qweight {tuple(parts['qweight'].shape)}, qzeros "
                f"{tuple(parts['qzeros'].shape)}, scales {tuple(scales.shape)} do not make one 4-bit weight "
                f"in groups of {self.group}"
            )
        return q, group, scales, zeros

    def decode(self, name: str, parts: Mapping[str, Tensor]) -> Tensor:
        q, group, scales, zeros = self.values(name, parts)
        return scales.T[:, group] * (q - zeros.T[:, group]).float()

    def packed(self, name: str, parts: Mapping[str, Tensor]) -> QuantizedTensor | None:
        q, group, scales, zeros = self.values(name, parts)
        rows, cols = q.shape
        block_group = group[::32]
        if cols % 32 or not torch.equal(group, block_group.repeat_interleave(32)):
            return None  # a block of 32 columns spans groups (activation order): decoded
        d = scales.T[:, block_group].half()
        m = (-scales * zeros.float()).T[:, block_group].half()
        nib = q.to(torch.uint8).reshape(rows, cols // 32, 2, 16)
        qs = nib[:, :, 0] | (nib[:, :, 1] << 4)
        blocks = torch.cat([d.unsqueeze(-1).view(torch.uint8), m.unsqueeze(-1).view(torch.uint8), qs], dim=-1)
        return QuantizedTensor(blocks.reshape(rows, -1).contiguous(), get_weight_format("q4_1"), (rows, cols))


def awq_order(values: Tensor) -> Tensor:
    """AWQ's unpacked values [R, C] in their columns' order."""
    return values.unflatten(-1, (-1, 8))[..., list(AWQ_ORDER)].flatten(-2)


def decoder_for(quantization: Mapping[str, Any]) -> Decoder | None:
    """The decoder of a config's ``quantization_config``, or None where none here reads it."""
    method = quantization.get("quant_method")
    if method in ("gptq", "awq"):
        return _grouped_int4(method, quantization)
    if method in ("fp8", "fbgemm_fp8"):
        return Fp8(_block(quantization.get("weight_block_size")))
    if method != "compressed-tensors":
        return None
    weights = [group.get("weights") or {} for group in (quantization.get("config_groups") or {}).values()]
    if not weights or any(w != weights[0] for w in weights):
        return None  # several schemes in one checkpoint: not read yet
    w = weights[0]
    if w.get("type") == "float" and w.get("num_bits") == 8:
        return Fp8(_block(w.get("block_structure")))
    if w.get("type") == "int" and quantization.get("format") == "pack-quantized" and 32 % int(w["num_bits"]) == 0:
        return PackedIntegers(w)
    return None


def _grouped_int4(method: str, quantization: Mapping[str, Any]) -> GroupedInt4:
    """The decoder of a GPTQ or AWQ config; an option not read yet is one error naming the field."""
    bits = quantization.get("bits", quantization.get("w_bit"))
    group = int(quantization.get("group_size", quantization.get("q_group_size", -1)))
    unread = None
    if bits != 4:
        unread = f"bits {bits!r} (4 is read)"
    elif group <= 0:
        unread = f"group_size {group} (groups of a row's columns are read)"
    elif method == "awq" and str(quantization.get("version", "gemm")).lower() != "gemm":
        unread = f"version {quantization['version']!r} (gemm is read)"
    elif method == "awq" and not quantization.get("zero_point", True):
        unread = "zero_point false"
    elif method == "gptq" and quantization.get("checkpoint_format", "gptq") != "gptq":
        unread = f"checkpoint_format {quantization['checkpoint_format']!r} (gptq is read)"
    if unread:
        raise ValueError(f"quantization_config quant_method {method!r} with {unread} is not read yet")
    return GroupedInt4(method, group, gptq_v1=method == "gptq")


def _block(block: Any) -> tuple[int, int] | None:
    return (int(block[0]), int(block[1])) if block else None


def decoded(weights: Weights, decoder: Decoder, dtype: torch.dtype) -> Iterator[tuple[str, Tensor | StoredTensor]]:
    """``weights`` with each quantized weight decoded to ``dtype`` (its parts consumed)."""
    pending: dict[str, dict[str, Tensor]] = {}  # module -> the parts of its weight come so far
    count = kept = 0
    for name, tensor in weights:
        module, _, leaf = name.rpartition(".")
        if leaf in DROPPED:
            continue
        if not decoder.is_part(leaf, tensor):
            yield name, tensor
            continue
        parts = pending.setdefault(module, {})
        parts[leaf] = whole(tensor)  # quantized weights and their scales are read whole
        if decoder.complete(parts):
            del pending[module]
            packed = decoder.packed(f"{module}.weight", parts)
            if packed is not None:
                kept += 1
                yield f"{module}.weight", packed
                continue
            count += 1
            yield f"{module}.weight", decoder.decode(f"{module}.weight", parts).to(dtype)
    if pending:
        module, parts = next(iter(pending.items()))
        raise ValueError(
            f"{module}.weight: its {decoder.name} tensors are incomplete in the checkpoint (found {sorted(parts)}; "
            f"{len(pending)} such weights)"
        )
    if kept:
        log.info(
            "kept %d %s weights packed (%d bytes per %d values)", kept, decoder.name, FP8_FORMAT.block_bytes, BLOCK
        )
    if count:
        log.info("decoded %d %s weights at load to %s (--isq q8_0 packs them again)", count, decoder.name, dtype)


def scaled(weight: Tensor, scale: Tensor, name: str, block: tuple[int, int] | None = None) -> Tensor:
    """``weight`` [N, K] (fp8) times ``scale`` (:func:`scales_of`), in fp32."""
    return weight.float() * scales_of(weight.shape, scale, name, block)


def scales_of(shape: Sequence[int], scale: Tensor, name: str, block: tuple[int, int] | None = None) -> Tensor:
    """The scale of each value of a weight of ``shape`` [..., N, K] (broadcast to it) given ``scale``: one
    value, one per row ([N] or [N, 1]) or one per ``block`` of bn x bk ([ceil(N / bn), ceil(K / bk)])."""
    scale = scale.float()
    rows, cols = shape[-2:]
    if scale.numel() == 1:
        return scale.reshape(()).expand(rows, cols)
    if block is None and (scale.dim() == 1 or scale.shape[-1] == 1):
        if scale.shape[0] != rows:
            raise ValueError(f"{name}: {scale.shape[0]} row scales for {rows} rows")
        return scale.reshape(rows, 1).expand(rows, cols)
    grid_rows, grid_cols = scale.shape[-2:]
    if block is None:  # no block size given: only blocks that divide the weight evenly are unambiguous
        if rows % grid_rows or cols % grid_cols:
            raise ValueError(f"{name}: scales {tuple(scale.shape)} for {(rows, cols)} values, and no block size")
        block = (rows // grid_rows, cols // grid_cols)
    block_rows, block_cols = block
    if (-(-rows // block_rows), -(-cols // block_cols)) != (grid_rows, grid_cols):
        raise ValueError(f"{name}: scales {tuple(scale.shape)} do not tile {(rows, cols)} values in blocks of {block}")
    expanded = scale.repeat_interleave(block_rows, -2).repeat_interleave(block_cols, -1)
    return expanded[..., :rows, :cols]

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
- MXFP4 and NVFP4 (:mod:`xinfer.quant.fp4_formats`: e2m1 codes two a byte, the even value in the low
  nibble): gpt-oss's ``quant_method`` ``"mxfp4"`` (``X_blocks`` [..., N, K / 32, 16] and ``X_scales``
  [..., N, K / 32] e8m0 for a parameter ``X``), compressed-tensors' ``mxfp4-pack-quantized``
  (``X.weight_packed`` [N, K / 2], ``X.weight_scale`` e8m0 [N, K / 32]) and ``nvfp4-pack-quantized``
  (the same with ``X.weight_scale`` e4m3 [N, K / 16] and ``X.weight_global_scale``, the weight being
  ``code * weight_scale / weight_global_scale``), and ModelOpt's ``quant_algo`` ``"NVFP4"``
  (``X.weight`` uint8 [N, K / 2], ``X.weight_scale`` e4m3 [N, K / 16], ``X.weight_scale_2``, the weight
  being ``code * weight_scale * weight_scale_2``). Kept packed (NVFP4 where rows are whole blocks of 128).

Activation scales (``input_scale``, ...) are not needed and are dropped.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from xinfer.loading.stored import StoredTensor, Weights, whole
from xinfer.quant.fp4_formats import (
    MXFP4_GROUP,
    NVFP4_BLOCK,
    NVFP4_GROUP,
    decode_e2m1,
    pack_mxfp4,
    pack_nvfp4,
    pair_codes,
)
from xinfer.quant.fp8_format import BLOCK, Fp8Format, pack
from xinfer.quant.tensor import QuantizedTensor, WeightFormat, get_weight_format, quantized

log = logging.getLogger("xinfer")

FP8_FORMAT = Fp8Format()
DROPPED = ("input_scale", "output_scale", "k_scale", "v_scale", "input_zero_point", "input_global_scale")


class Decoder:
    """How one quantization's tensors become the weight they stand for."""

    name: str
    parts: tuple[str, ...]  # the leaf names of a quantized weight's tensors (besides a plain ``weight``)

    def is_part(self, leaf: str, tensor: Tensor | StoredTensor) -> bool:
        return leaf in self.parts

    def split(self, name: str) -> tuple[str, str]:
        """The weight checkpoint tensor ``name`` (one of its parts) belongs to, and the part's name."""
        module, _, leaf = name.rpartition(".")
        return f"{module}.weight", leaf

    def complete(self, parts: Mapping[str, Tensor]) -> bool:
        raise NotImplementedError

    def decode(self, name: str, parts: Mapping[str, Tensor]) -> Tensor:
        """The weight ``name`` in fp32 from its ``parts``."""
        raise NotImplementedError

    def packed(self, name: str, parts: Mapping[str, Tensor]) -> QuantizedTensor | None:
        """The weight ``name`` kept packed, where a weight format holds its values exactly; else None."""
        return None

    def held(self, name: str, parts: Mapping[str, Tensor], dtype: torch.dtype) -> Tensor:
        """The weight ``name`` on the meta device as loading holds it, packed or in ``dtype``, from its ``parts``
        on the meta device (their shapes and dtypes: no values)."""
        packed = self.packed(name, parts)
        return packed if packed is not None else self.decode(name, parts).to(dtype)


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
        if scale_columns(cols, scale, self.block) % BLOCK:
            return None  # blocks narrower than 128 columns: no one scale per packed block
        return QuantizedTensor(pack(codes, runs[..., 0]), FP8_FORMAT, (rows, cols))


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

    def shape(self, name: str, parts: Mapping[str, Tensor]) -> tuple[int, int]:
        """The weight's rows and columns (``weight_shape``'s values); scales of another shape than they and the
        group size make are one error."""
        rows, cols = (int(n) for n in parts["weight_shape"].tolist())
        scale = parts["weight_scale"]
        groups = -(-cols // self.group) if self.group else 1
        if tuple(scale.shape) != (rows, groups):
            raise ValueError(f"{name}: scales {tuple(scale.shape)} for {(rows, cols)} values in groups of "
                             f"{self.group or cols} columns: {(rows, groups)} expected")  # fmt: skip
        return rows, cols

    def decode(self, name: str, parts: Mapping[str, Tensor]) -> Tensor:
        rows, cols = self.shape(name, parts)
        q = unpack_rows(parts["weight_packed"], self.bits, cols)
        scale = parts["weight_scale"].float()
        zero = parts.get("weight_zero_point")
        zeros = unpack_rows(zero.T.contiguous(), self.bits, rows).T if zero is not None else torch.zeros_like(scale)
        group = parts.get("weight_g_idx")
        group = group.long() if group is not None else torch.arange(cols) // (self.group or cols)
        if int(group.max()) >= scale.shape[1]:
            raise ValueError(f"{name}: {scale.shape[1]} groups of scales for {cols} columns")
        return (q.float() - zeros[:, group].float()) * scale[:, group]

    def held(self, name: str, parts: Mapping[str, Tensor], dtype: torch.dtype) -> Tensor:
        """Decoded (``weight_shape`` is read at the header stage too: :func:`~xinfer.loading.safetensors.header_tensors`)."""
        return torch.empty(self.shape(name, parts), dtype=dtype, device="meta")


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
    input columns and stores each zero less one by subtracting 1 from every nibble of the word at once (its
    ``checkpoint_format`` ``gptq``; not ``gptq_v2``): a zero of 0 borrows from the nibble above, which adding
    ``0x11111111`` back to the word undoes, as GPTQModel converts such checkpoints. ``X.g_idx`` holds each input column's group (activation order, ``desc_act``, makes it a permutation). AWQ
    (``version`` ``gemm``) packs both ``qweight`` [K, N / 8] and ``qzeros`` along the output rows, its 8
    values a word in the order :data:`AWQ_ORDER` undoes.

    Kept packed as Q4_1 (``d * q + m``, blocks of 32: ``d`` the scale, ``m = -scale * zero`` rounded to
    fp16) where each block of 32 columns is in one group, else decoded at load."""

    name = "4-bit"

    def __init__(self, method: str, group: int, act_order: bool = False):
        self.method, self.group, self.act_order = method, group, act_order  # act_order: GPTQ's desc_act
        self.parts = ("qweight", "qzeros", "scales", "g_idx") if method == "gptq" else ("qweight", "qzeros", "scales")

    def complete(self, parts: Mapping[str, Tensor]) -> bool:
        return set(self.parts) <= parts.keys()

    def values(self, name: str, parts: Mapping[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """q [N, K], each column's group [K], the scales and zeros [groups, N]."""
        self.shape(name, parts)
        scales = parts["scales"].float()
        if self.method == "gptq":
            q = unpack_words(parts["qweight"].T, 4)
            zeros = unpack_words((parts["qzeros"].long() + 0x11111111) & 0xFFFFFFFF, 4)
            group = parts["g_idx"].long()
        else:
            q = awq_order(unpack_words(parts["qweight"], 4)).T
            zeros = awq_order(unpack_words(parts["qzeros"], 4))
            group = torch.arange(q.shape[1]) // self.group
        if int(group.max()) >= scales.shape[0]:  # (g_idx's values)
            raise self.contradiction(name, parts)
        return q, group, scales, zeros

    def shape(self, name: str, parts: Mapping[str, Tensor]) -> tuple[int, int]:
        """The weight's rows and columns, from its tensors' shapes; shapes that do not make one weight are one
        error."""
        qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
        groups, rows = scales.shape
        if self.method == "gptq":
            q_rows, cols = qweight.shape[1], qweight.shape[0] * 8
            indexed = tuple(parts["g_idx"].shape) == (cols,) and -(-cols // self.group) == groups
        else:
            q_rows, cols = qweight.shape[1] * 8, qweight.shape[0]
            indexed = -(-cols // self.group) == groups
        if q_rows != rows or (qzeros.shape[0], qzeros.shape[1] * 8) != (groups, rows) or not indexed:
            raise self.contradiction(name, parts)
        return rows, cols

    def contradiction(self, name: str, parts: Mapping[str, Tensor]) -> ValueError:
        return ValueError(
            f"{name}: {self.method} tensors of shapes qweight {tuple(parts['qweight'].shape)}, qzeros "
            f"{tuple(parts['qzeros'].shape)}, scales {tuple(parts['scales'].shape)} do not make one 4-bit weight "
            f"in groups of {self.group}"
        )

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

    def held(self, name: str, parts: Mapping[str, Tensor], dtype: torch.dtype) -> Tensor:
        """Packed as Q4_1 where each block of 32 columns is in one group without activation order (with it,
        the groups ``g_idx`` holds decide, counted decoded), else decoded."""
        rows, cols = self.shape(name, parts)
        if cols % 32 or self.group % 32 or self.act_order:
            return torch.empty(rows, cols, dtype=dtype, device="meta")
        q4_1 = get_weight_format("q4_1")
        return QuantizedTensor(torch.empty(rows, q4_1.row_bytes(cols), dtype=torch.uint8, device="meta"), q4_1,
                               (rows, cols))  # fmt: skip


def awq_order(values: Tensor) -> Tensor:
    """AWQ's unpacked values [R, C] in their columns' order."""
    return values.unflatten(-1, (-1, 8))[..., list(AWQ_ORDER)].flatten(-2)


class Fp4(Decoder):
    """e2m1 codes two a byte ([..., N, K / 2], the even value low) with a scale per ``group`` values:
    MXFP4's e8m0 (``group`` 32) or NVFP4's e4m3 (16) times a float32 per tensor. ``leaves`` names the
    checkpoint's tensors: the codes, the group scales and (NVFP4) the tensor scale, which the weight is
    multiplied by or, where ``divides``, divided by."""

    def __init__(self, leaves: tuple[str, ...], group: int, divides: bool = False):
        self.parts, self.group, self.divides = leaves, group, divides
        self.name = "MXFP4" if group == MXFP4_GROUP else "NVFP4"
        self.format = get_weight_format(self.name.lower())

    def is_part(self, leaf: str, tensor: Tensor | StoredTensor) -> bool:
        return leaf in self.parts[1:] or (leaf == self.parts[0] and tensor.dtype == torch.uint8)

    def complete(self, parts: Mapping[str, Tensor]) -> bool:
        return set(self.parts) <= parts.keys()

    def values(self, name: str, parts: Mapping[str, Tensor]) -> tuple[Tensor, Tensor, Tensor | None]:
        """The codes [..., N, K] in value order, the group scales [..., N, K / group] and the tensor scale."""
        packed, scales = parts[self.parts[0]], parts[self.parts[1]]
        if packed.dim() == scales.dim() + 1:  # gpt-oss: the blocks of each row's groups, [..., N, K / 32, 16]
            packed = packed.flatten(-2)
        *outer, half_cols = packed.shape
        expected = (*outer, 2 * half_cols // self.group)
        scale_type = "e4m3" if self.group == NVFP4_GROUP else "e8m0"
        if (packed.dtype != torch.uint8 or tuple(scales.shape) != expected or (2 * half_cols) % self.group
                or not _is(scales, scale_type)):  # fmt: skip
            raise ValueError(
                f"{name}: {self.name} codes {tuple(parts[self.parts[0]].shape)} ({packed.dtype}) and scales "
                f"{tuple(scales.shape)} ({scales.dtype}) do not make one weight: expected uint8 codes [..., N, K / 2] "
                f"and {scale_type} scales [..., N, K / {self.group}]"
            )
        if len(self.parts) < 3:
            return pair_codes(packed), scales, None
        tensor_scale = parts[self.parts[2]].float()
        if tensor_scale.numel() not in (1, math.prod(outer[:-1])):  # one per tensor, or per stacked expert
            raise ValueError(f"{name}: {self.parts[2]} of shape {tuple(tensor_scale.shape)} for a weight of "
                             f"{(*outer, 2 * half_cols)} values: one per tensor expected")  # fmt: skip
        tensor_scale = tensor_scale.reshape(*outer[:-1], 1, 1) if tensor_scale.numel() > 1 else tensor_scale.reshape(())
        return pair_codes(packed), scales, 1 / tensor_scale if self.divides else tensor_scale

    def packed(self, name: str, parts: Mapping[str, Tensor]) -> QuantizedTensor | None:
        codes, scales, tensor_scale = self.values(name, parts)
        shape = codes.shape
        if tensor_scale is None:
            return quantized(pack_mxfp4(codes, scales.view(torch.uint8)), self.format, shape, name)
        if shape[-1] % NVFP4_BLOCK:
            return None  # rows not whole blocks of 128: decoded
        return quantized(pack_nvfp4(codes, scales, tensor_scale), self.format, shape, name)

    def decode(self, name: str, parts: Mapping[str, Tensor]) -> Tensor:
        codes, scales, tensor_scale = self.values(name, parts)
        if tensor_scale is None:
            return self.format.dequantize(pack_mxfp4(codes, scales.view(torch.uint8)))
        steps = scales.float() * tensor_scale
        return (decode_e2m1(codes).unflatten(-1, (-1, NVFP4_GROUP)) * steps[..., None]).flatten(-2)


def _is(scales: Tensor, scale_type: str) -> bool:
    """Whether ``scales`` hold e4m3 values, or e8m0 bytes (uint8 or torch's float8_e8m0fnu)."""
    if scale_type == "e4m3":
        return scales.dtype == torch.float8_e4m3fn
    return scales.dtype == torch.uint8 or "e8m0" in str(scales.dtype)


class GptOssMxfp4(Fp4):
    """gpt-oss's MXFP4: a parameter ``X`` stored as ``X_blocks`` and ``X_scales``."""

    def __init__(self) -> None:
        super().__init__(("blocks", "scales"), MXFP4_GROUP)

    def is_part(self, leaf: str, tensor: Tensor | StoredTensor) -> bool:
        return leaf.endswith(("_blocks", "_scales"))

    def split(self, name: str) -> tuple[str, str]:
        weight, _, part = name.rpartition("_")
        return weight, part


def decoder_for(quantization: Mapping[str, Any]) -> Decoder | None:
    """The decoder of a config's ``quantization_config``, or None where none here reads it."""
    method = quantization.get("quant_method")
    if method in ("gptq", "awq"):
        return _grouped_int4(method, quantization)
    if method in ("fp8", "fbgemm_fp8"):
        return Fp8(_block(quantization.get("weight_block_size")))
    if method == "mxfp4":
        return GptOssMxfp4()
    if method == "modelopt":  # its fields flat, or under "quantization" as in hf_quant_config.json
        return _modelopt({**quantization, **(quantization.get("quantization") or {})})
    if method != "compressed-tensors":
        return None
    return _compressed_tensors(quantization)


def _compressed_tensors(quantization: Mapping[str, Any]) -> Decoder | None:
    """The decoder of a compressed-tensors config (None where no weights are quantized); a scheme not read yet
    is one error naming its fields."""
    fmt = quantization.get("format")
    weights = [group.get("weights") or {} for group in (quantization.get("config_groups") or {}).values()]
    if not any(weights):
        return None
    if any(w != weights[0] for w in weights):
        raise ValueError(f"quantization_config format {fmt!r} with {len(weights)} config_groups of different weights "
                         "schemes is not read yet (one scheme for every quantized layer is)")  # fmt: skip
    w = weights[0]
    if w.get("type") == "float" and w.get("num_bits") == 8:
        return Fp8(_block(w.get("block_structure")))
    if fmt in ("mxfp4-pack-quantized", "nvfp4-pack-quantized"):
        return _compressed_fp4(fmt, w)
    if w.get("type") == "int" and fmt == "pack-quantized" and w.get("num_bits") in (2, 4, 8):
        return PackedIntegers(w)
    raise ValueError(
        f"quantization_config format {fmt!r} with weights type {w.get('type')!r} num_bits {w.get('num_bits')!r} is "
        "not read yet (pack-quantized int 2/4/8, float-quantized float 8, mxfp4- and nvfp4-pack-quantized are)"
    )


def _modelopt(quantization: Mapping[str, Any]) -> Fp4 | None:
    """The decoder of ModelOpt's NVFP4 (its other algorithms are not read: None); a group size not read yet is
    one error naming the field."""
    if quantization.get("quant_algo") != "NVFP4":
        return None
    group = quantization.get("group_size", NVFP4_GROUP)
    if group != NVFP4_GROUP:
        raise ValueError(f"quantization_config quant_algo 'NVFP4' with group_size {group!r} is not read yet (16 is)")
    return Fp4(("weight", "weight_scale", "weight_scale_2"), NVFP4_GROUP)


def _compressed_fp4(fmt: str, weights: Mapping[str, Any]) -> Fp4:
    """The decoder of compressed-tensors' ``mxfp4-`` or ``nvfp4-pack-quantized``; an option not read yet is
    one error naming the field."""
    nvfp4 = fmt.startswith("nvfp4")
    group = NVFP4_GROUP if nvfp4 else MXFP4_GROUP
    for field, expected in (("num_bits", 4), ("type", "float"), ("group_size", group)):
        if weights.get(field) != expected:
            raise ValueError(f"quantization_config format {fmt!r} with weights {field} {weights.get(field)!r} "
                             f"is not read yet ({expected!r} is)")  # fmt: skip
    if nvfp4:
        return Fp4(("weight_packed", "weight_scale", "weight_global_scale"), group, divides=True)
    return Fp4(("weight_packed", "weight_scale"), group)


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
    return GroupedInt4(method, group, method == "gptq" and bool(quantization.get("desc_act")))


def _block(block: Any) -> tuple[int, int] | None:
    return (int(block[0]), int(block[1])) if block else None


def decoded(weights: Weights, decoder: Decoder, dtype: torch.dtype) -> Iterator[tuple[str, Tensor | StoredTensor]]:
    """``weights`` with each quantized weight decoded to ``dtype`` (its parts consumed)."""
    pending: dict[str, dict[str, Tensor]] = {}  # weight -> its parts come so far
    count = kept = 0
    kept_format: WeightFormat = FP8_FORMAT
    for name, tensor in weights:
        leaf = name.rpartition(".")[2]
        if leaf in DROPPED:
            continue
        if not decoder.is_part(leaf, tensor):
            yield name, tensor
            continue
        weight, part = decoder.split(name)
        parts = pending.setdefault(weight, {})
        parts[part] = whole(tensor)  # quantized weights and their scales are read whole
        if decoder.complete(parts):
            del pending[weight]
            if any(p.is_meta for p in parts.values()):  # from the files' headers (loader.held_model)
                yield weight, decoder.held(weight, parts, dtype)
                continue
            packed = decoder.packed(weight, parts)
            if packed is not None:
                kept, kept_format = kept + 1, packed.format
                yield weight, packed
                continue
            count += 1
            yield weight, decoder.decode(weight, parts).to(dtype)
    if pending:
        weight, parts = next(iter(pending.items()))
        raise ValueError(
            f"{weight}: its {decoder.name} tensors are incomplete in the checkpoint (found {sorted(parts)}; "
            f"{len(pending)} such weights)"
        )
    if kept:
        log.info("kept %d %s weights packed (%d bytes per %d values)", kept, decoder.name, kept_format.block_bytes,
                 kept_format.block_values)  # fmt: skip
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


def scale_columns(cols: int, scale: Tensor, block: tuple[int, int] | None = None) -> int:
    """How many consecutive values of a row of ``cols`` share a scale, for ``scale`` as :func:`scales_of` reads
    it (one value, one a row, or one a block)."""
    if scale.numel() == 1 or (block is None and (scale.dim() == 1 or scale.shape[-1] == 1)):
        return cols
    return block[1] if block is not None else cols // scale.shape[-1]

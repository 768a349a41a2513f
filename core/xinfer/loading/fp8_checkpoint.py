"""Checkpoints whose weights are stored in FP8 e4m3, each ``X.weight`` beside its scale:

- ``quant_method: "fp8"`` (DeepSeek V3/R1, Qwen3-FP8, MiniMax-M2, GLM-4.x-FP8): ``X.weight_scale_inv``,
  one fp32 scale per ``weight_block_size`` block (128 x 128), the blocks at the right and bottom
  edges partial;
- ``"fbgemm_fp8"`` and ``"compressed-tensors"`` with 8-bit float weights: ``X.weight_scale``, one
  per tensor, per output row or per block.

The weight is ``fp8 * scale`` in every case (``weight_scale_inv`` is the inverse of the scale the
values were divided by). Until xinfer computes on FP8 weights, they are dequantized here to the
model's dtype (one log line says so): the model takes a float checkpoint's memory, and ``--isq``
packs it again. Activation scales (``input_scale``) are not needed and are dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger("xinfer")

SCALE_NAMES = ("weight_scale_inv", "weight_scale")
DROPPED = ("input_scale", "output_scale", "k_scale", "v_scale")


def fp8_checkpoint(quantization: Mapping[str, Any]) -> bool:
    """Whether ``quantization`` (a config's ``quantization_config``) stores FP8 weights this module reads."""
    method = quantization.get("quant_method")
    if method in ("fp8", "fbgemm_fp8"):
        return True
    if method == "compressed-tensors":
        weights = _compressed_weights(quantization)
        return bool(weights) and all(w.get("type") == "float" and w.get("num_bits") == 8 for w in weights)
    return False


def block_size(quantization: Mapping[str, Any]) -> tuple[int, int] | None:
    """The rows x columns one scale covers, where the scales are per block."""
    block = quantization.get("weight_block_size")
    if block is None and quantization.get("quant_method") == "compressed-tensors":
        blocks = {tuple(w["block_structure"]) for w in _compressed_weights(quantization) if w.get("block_structure")}
        block = blocks.pop() if len(blocks) == 1 else None
    return (int(block[0]), int(block[1])) if block else None


def _compressed_weights(quantization: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [group.get("weights") or {} for group in (quantization.get("config_groups") or {}).values()]


def dequantized(
    weights: Iterable[tuple[str, Tensor]], dtype: torch.dtype, block: tuple[int, int] | None
) -> Iterator[tuple[str, Tensor]]:
    """``weights`` with each FP8 weight multiplied by its scale (per ``block`` where the scales are
    per block), in ``dtype``, and the scales consumed."""
    pending: dict[str, dict[str, Tensor]] = {}  # module -> what has come of its fp8 weight and its scale
    count = 0
    for name, tensor in weights:
        module, _, leaf = name.rpartition(".")
        if leaf in DROPPED:
            continue
        if leaf not in SCALE_NAMES and not (leaf == "weight" and tensor.dtype == torch.float8_e4m3fn):
            yield name, tensor
            continue
        pair = pending.setdefault(module, {})
        pair["scale" if leaf in SCALE_NAMES else "weight"] = tensor
        if len(pair) == 2:
            del pending[module]
            count += 1
            yield f"{module}.weight", scaled(pair["weight"], pair["scale"], f"{module}.weight", block).to(dtype)
    if pending:
        module, pair = next(iter(pending.items()))
        missing = "scale" if "weight" in pair else "FP8 weight"
        raise ValueError(f"{module}.weight: its {missing} is not in the checkpoint ({len(pending)} such modules)")
    if count:
        log.info("dequantized %d FP8 weights at load to %s (--isq q8_0 packs them again)", count, dtype)


def scaled(weight: Tensor, scale: Tensor, name: str, block: tuple[int, int] | None = None) -> Tensor:
    """``weight`` [N, K] (fp8) times ``scale``: one value, one per row ([N] or [N, 1]) or one per
    ``block`` of bn x bk ([ceil(N / bn), ceil(K / bk)]), in fp32."""
    values, scale = weight.float(), scale.float()
    rows, cols = values.shape[-2:]
    if scale.numel() == 1:
        return values * scale.reshape(())
    if block is None and (scale.dim() == 1 or scale.shape[-1] == 1):
        if scale.shape[0] != rows:
            raise ValueError(f"{name}: {scale.shape[0]} row scales for {rows} rows")
        return values * scale.reshape(rows, 1)
    grid_rows, grid_cols = scale.shape[-2:]
    if block is None:  # no block size given: only blocks that divide the weight evenly are unambiguous
        if rows % grid_rows or cols % grid_cols:
            raise ValueError(f"{name}: scales {tuple(scale.shape)} for {(rows, cols)} values, and no block size")
        block = (rows // grid_rows, cols // grid_cols)
    block_rows, block_cols = block
    if (-(-rows // block_rows), -(-cols // block_cols)) != (grid_rows, grid_cols):
        raise ValueError(f"{name}: scales {tuple(scale.shape)} do not tile {(rows, cols)} values in blocks of {block}")
    expanded = scale.repeat_interleave(block_rows, -2).repeat_interleave(block_cols, -1)
    return values * expanded[..., :rows, :cols]

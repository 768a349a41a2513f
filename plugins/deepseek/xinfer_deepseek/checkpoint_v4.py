"""DeepSeek V4 checkpoints as DeepSeek publishes them: their tensor names renamed to transformers'
(the ones the model keeps), their MXFP4 weights kept packed and their FP8 ones decoded at load.

Quantized weights come as ``X.weight`` with a companion ``X.scale``:

- MXFP4 (the routed experts): ``weight`` int8 [out, in / 2], two e2m1 values per byte (the low
  nibble first), ``scale`` [out, in / 32] e8m0, one power of two per 32 values;
- FP8 (the other projections): ``weight`` e4m3 [out, in], ``scale`` fp32 or e8m0, one per block
  of ``out / scale rows`` x ``in / scale columns``.

MXFP4 weights stay packed (:mod:`xinfer.quant.fp4_formats`, the file's 4.25 bits a value); FP8 ones
are dequantized here to the model's dtype (one log line counts each).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import torch
from torch import Tensor

from xinfer.loading.stored import StoredTensor, Weights, whole
from xinfer.quant import QuantizedTensor, get_weight_format, quantized
from xinfer.quant.fp4_formats import pack_mxfp4, pair_codes

log = logging.getLogger(__name__)

# e2m1: sign, 2 exponent bits, 1 mantissa bit, by the code's 4 bits
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# DeepSeek's names -> transformers', applied in order to every name (the top-level ones also under ``model.``: the
# checkpoint of transformers' DeepseekV4Model, read as DeepseekV4ForCausalLM's)
_RENAMES = [
    (r"^(?:model\.)?embed\.weight$", "model.embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^norm\.weight$", "model.norm.weight"),
    (r"^(?:model\.)?hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
    (r"^layers\.", "model.layers."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn\.indexer\.compressor\.", ".attn.compressor.indexer."),
    (r"\.attn\.indexer\.wq_b\.", ".attn.compressor.indexer.q_b_proj."),
    (r"\.attn\.indexer\.weights_proj\.", ".attn.compressor.indexer.scorer.weights_proj."),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.attn_sink$", ".sinks"),
    (r"\.(self_attn|compressor|indexer)\.norm\.", r".\1.kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.wq_b\.", ".q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.(experts\.\d+|shared_experts)\.w1\.", r".\1.gate_proj."),
    (r"\.(experts\.\d+|shared_experts)\.w2\.", r".\1.down_proj."),
    (r"\.(experts\.\d+|shared_experts)\.w3\.", r".\1.up_proj."),
]
_RENAMES_COMPILED = [(re.compile(pattern), target) for pattern, target in _RENAMES]


def hf_name(name: str) -> str:
    """transformers' name of checkpoint tensor ``name``: DeepSeek's own names, as transformers saves
    them (the same, under ``model.``) or already transformers' (unchanged); ``mtp.*`` kept."""
    if name.startswith("mtp."):
        return name
    for pattern, target in _RENAMES_COMPILED:
        name = pattern.sub(target, name)
    return name


def hf_names(weights: Weights) -> Iterator[tuple[str, Tensor | StoredTensor]]:
    """``weights`` under transformers' names, each MXFP4 weight packed and each FP8 weight dequantized (their
    scales consumed)."""
    pending: dict[str, dict[str, Tensor]] = {}
    counts = {"MXFP4": 0, "FP8": 0}
    for name, tensor in weights:
        base, _, leaf = name.rpartition(".")
        quantized = (leaf == "scale" and not base.endswith("_hc")) or (leaf == "weight" and _is_quantized(tensor))
        if not quantized or name.startswith("mtp."):
            yield hf_name(name), tensor
            continue
        pair = pending.setdefault(base, {})
        pair[leaf] = whole(tensor)
        if len(pair) == 2:
            del pending[base]
            name = hf_name(f"{base}.weight")
            if pair["weight"].dtype == torch.float8_e4m3fn:
                counts["FP8"] += 1
                yield name, dequantize(pair["weight"], pair["scale"])
            else:
                counts["MXFP4"] += 1
                yield name, mxfp4(pair["weight"], pair["scale"], name)
    if pending:
        raise ValueError(f"quantized weights without their scale (or scales without a weight): {sorted(pending)[:4]}")
    if counts["MXFP4"]:
        log.info("kept %d MXFP4 weights packed (17 bytes per 32 values)", counts["MXFP4"])
    if counts["FP8"]:
        log.info("dequantized %d FP8 weights at load: xinfer computes on them in the model's dtype", counts["FP8"])


def mxfp4(weight: Tensor, scale: Tensor, name: str) -> QuantizedTensor:
    """An MXFP4 weight (the module's docstring) kept packed; a scale of another shape is one error naming it."""
    codes = pair_codes(weight)
    e8m0 = scale.dtype == torch.uint8 or "e8m0" in str(scale.dtype)
    if not e8m0 or scale.shape != (*codes.shape[:-1], codes.shape[-1] // 32):
        raise ValueError(f"{name}: MXFP4 codes {tuple(weight.shape)} and scales {tuple(scale.shape)} ({scale.dtype}) "
                         "do not make one weight: expected e8m0 scales [out, in / 32]")  # fmt: skip
    return quantized(pack_mxfp4(codes, scale.view(torch.uint8)), get_weight_format("mxfp4"), codes.shape, name)


def _is_quantized(tensor: Tensor | StoredTensor) -> bool:
    return tensor.dtype in (torch.int8, torch.uint8, torch.float8_e4m3fn) or "float4" in str(tensor.dtype)


def dequantize(weight: Tensor, scale: Tensor) -> Tensor:
    """A quantized weight (the module's docstring) in fp32."""
    values = decode_e2m1(weight) if weight.dtype != torch.float8_e4m3fn else weight.float()
    scales = _scale_values(scale)
    rows, cols = values.shape
    block_rows, block_cols = rows // scales.shape[0], cols // scales.shape[1]
    if block_rows * scales.shape[0] != rows or block_cols * scales.shape[1] != cols:
        raise ValueError(
            f"a weight of {tuple(values.shape)} values does not split into scale blocks {tuple(scales.shape)}"
        )
    blocks = values.view(scales.shape[0], block_rows, scales.shape[1], block_cols)
    return (blocks * scales[:, None, :, None]).view(rows, cols)


def decode_e2m1(packed: Tensor) -> Tensor:
    """[..., n] bytes of two e2m1 codes each (low nibble first) -> [..., 2n] fp32 values."""
    codes = packed.contiguous().view(torch.uint8)
    table = torch.tensor(E2M1, dtype=torch.float32, device=packed.device)
    return torch.stack((table[(codes & 0xF).long()], table[(codes >> 4).long()]), dim=-1).flatten(-2)


def _scale_values(scale: Tensor) -> Tensor:
    """Scales in fp32: e8m0 bytes (``float8_e8m0fnu`` or uint8) are ``2 ** (byte - 127)``."""
    if scale.dtype == torch.uint8 or "e8m0" in str(scale.dtype):
        return torch.exp2(scale.contiguous().view(torch.uint8).float() - 127)
    return scale.float()

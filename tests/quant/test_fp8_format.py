"""FP8 weights kept packed (:mod:`xinfer.quant.fp8_format`): the format's bytes against torch's own e4m3
(the test lays out each block's float32 scale and codes itself), and FP8 checkpoints whose blocks hold
128 columns loading packed and computing what transformers' float model of their values computes."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen3MoeConfig

from tests.plugins.hf_parity import assert_greedy_tokens_and_logprobs_match, assert_prefill_logits_match, randomize
from tests.quant.test_quantized_checkpoint import ROWS, fp8_model
from tests.tiny_models import COMMON, prefill_logits, prompt, save_tiny_model
from xinfer import LLM
from xinfer.layers.linear import Linear
from xinfer.quant import QuantizedTensor, get_weight_format

WIDE = {**COMMON, "hidden_size": 128, "intermediate_size": 256}  # rows of whole 128-value blocks
BLOCKS_128 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def test_dequantize_reads_a_float32_scale_then_128_e4m3_codes_per_block():
    codes = torch.randn(3, 256).mul(100).to(torch.float8_e4m3fn)
    scales = torch.rand(3, 2) + 0.5
    raw = torch.cat(
        [torch.cat([scales[:, b : b + 1].contiguous().view(torch.uint8), codes[:, 128 * b : 128 * (b + 1)]
                    .view(torch.uint8)], dim=1) for b in range(2)], dim=1,
    )  # fmt: skip
    expected = codes.float() * scales.repeat_interleave(128, dim=1)
    assert torch.equal(get_weight_format("fp8").dequantize(raw), expected)


def test_quantize_takes_each_block_to_its_own_scale():
    fmt = get_weight_format("fp8")
    weight = torch.randn(4, 384) * torch.tensor([1e-3, 1.0, 50.0, 0.0])[:, None]
    back = fmt.dequantize(fmt.quantize(weight))
    assert torch.all((back - weight).abs() <= weight.abs() * 2**-4 + 1e-30)  # e4m3's 3 mantissa bits
    assert back[:, ::128].ne(0).any() and torch.equal(back[3], weight[3])


def packed_projections(llm) -> list[QuantizedTensor]:
    model = llm.engine.model
    weights = [p for m in model.modules() for p in m.parameters(recurse=False) if isinstance(p, QuantizedTensor)]
    assert weights and all(w.format.name == "fp8" for w in weights)
    return weights


@pytest.mark.parametrize("quantization", [BLOCKS_128, ROWS], ids=["fp8-blocks-128x128", "compressed-tensors-rows"])
def test_fp8_checkpoint_stays_packed_and_computes_what_its_values_stand_for(quantization, tmp_path):
    config = LlamaConfig(**WIDE, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    hf, llm = fp8_model(config, tmp_path, quantization)
    weights = packed_projections(llm)
    assert len(weights) == 2 * 4  # per layer: the merged qkv, o, the merged gate/up, down
    assert_prefill_logits_match(hf, llm, 29)
    assert_greedy_tokens_and_logprobs_match(hf, llm, 11)


def test_fp8_experts_stay_packed(tmp_path):
    config = Qwen3MoeConfig(
        **{**WIDE, "num_hidden_layers": 1}, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
        tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"],
    )  # fmt: skip
    hf, llm = fp8_model(config, tmp_path, BLOCKS_128)
    experts = [m for m in llm.engine.model.modules() if hasattr(m, "w13")]
    assert experts and all(isinstance(m.w13, QuantizedTensor) and isinstance(m.w2, QuantizedTensor) for m in experts)
    assert_greedy_tokens_and_logprobs_match(hf, llm, 11)


def test_isq_fp8_packs_the_linears_of_a_float_checkpoint(tmp_path):
    """Within e4m3's 3 mantissa bits: q8_0 stays within 0.02 and q4_0 within 0.25 (test_loading.py)."""
    config = LlamaConfig(**WIDE, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    hf = save_tiny_model(config, tmp_path)
    randomize(hf)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    float_llm = LLM(model=str(tmp_path), dtype="float32", num_blocks=64)
    llm = LLM(model=str(tmp_path), dtype="float32", num_blocks=64, isq="fp8")
    linears = [m for m in llm.engine.model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.weight, QuantizedTensor) and m.weight.format.name == "fp8" for m in linears)
    expected, got = prefill_logits(float_llm.engine, prompt(24)), prefill_logits(llm.engine, prompt(24))
    error = float((got - expected).abs().max() / expected.abs().max())
    assert 0 < error <= 0.15, f"max|diff|/max|logit| = {error:.3f}"

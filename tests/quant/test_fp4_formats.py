"""MXFP4 and NVFP4 weights kept packed (:mod:`xinfer.quant.fp4_formats`). The test quantizes by the specs
itself: e2m1's 16 values spelled out below (OCP Microscaling Formats v1.0, section 5.3.3: sign, two exponent
bits of bias 1, one mantissa bit), each value the nearest of them (a brute-force argmin), MXFP4's scale the
power of two 2**(floor(log2(amax)) - 2) per 32 values (section 6.3), NVFP4's an e4m3 per 16 values times a
float32 per tensor. Checkpoints in each layout the loader reads (compressed-tensors' mxfp4- and
nvfp4-pack-quantized, ModelOpt's NVFP4, gpt-oss' ``_blocks``/``_scales``) must load packed and compute what
transformers' float model of the values they stand for computes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

from tests.plugins.hf_parity import assert_greedy_tokens_and_logprobs_match, randomize
from tests.tiny_models import COMMON, save_tiny_model
from xinfer import LLM
from xinfer.layers.linear import Linear
from xinfer.loading.quantized_checkpoint import decoded, decoder_for
from xinfer.quant import QuantizedTensor, get_weight_format

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
WIDE = {**COMMON, "hidden_size": 128, "intermediate_size": 256}  # rows of whole 128-value blocks
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def nearest_codes(values: torch.Tensor) -> torch.Tensor:
    return (values.unsqueeze(-1) - E2M1).abs().argmin(-1).to(torch.uint8)


def file_bytes(codes: torch.Tensor) -> torch.Tensor:
    """Two codes a byte, the even value in the low nibble (every layout's files)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, e8m0 scale bytes [..., K / 32], the weight they stand for)."""
    groups = weight.float().unflatten(-1, (-1, 32))
    exponent = torch.floor(torch.log2(groups.abs().amax(-1).clamp_min(2**-100))) - 2
    codes = nearest_codes(groups / torch.exp2(exponent)[..., None])
    meant = E2M1[codes.long()] * torch.exp2(exponent)[..., None]
    return codes.flatten(-2), (exponent + 127).to(torch.uint8), meant.flatten(-2)


def nvfp4(weight: torch.Tensor, tensor_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, e4m3 scales [..., K / 16], the weight they stand for) under ``tensor_scale``."""
    groups = weight.float().unflatten(-1, (-1, 16))
    scales = (groups.abs().amax(-1) / 6 / tensor_scale).to(torch.float8_e4m3fn)
    steps = scales.float() * tensor_scale
    codes = nearest_codes(groups / steps[..., None])
    return codes.flatten(-2), scales, (E2M1[codes.long()] * steps[..., None]).flatten(-2)


def checkpoint_tensors(name: str, weight: torch.Tensor, layout: str) -> tuple[dict, torch.Tensor]:
    """The tensors that store weight ``name`` in ``layout``, and the weight they stand for."""
    module = name.removesuffix(".weight")
    if layout in ("mxfp4-pack-quantized", "gpt-oss"):
        codes, scales, meant = mxfp4(weight)
        if layout == "gpt-oss":
            blocks = file_bytes(codes).unflatten(-1, (-1, 16))
            return {f"{name}_blocks": blocks, f"{name}_scales": scales}, meant
        return {f"{module}.weight_packed": file_bytes(codes), f"{module}.weight_scale": scales}, meant
    largest = float(weight.abs().max())
    if layout == "nvfp4-pack-quantized":  # the file's global scale divides: 448 * 6 / amax
        divisor = torch.tensor([448 * 6 / largest])
        codes, scales, _ = nvfp4(weight, 1 / float(divisor))
        meant = (E2M1[codes.long()].unflatten(-1, (-1, 16)) * (scales.float() / divisor)[..., None]).flatten(-2)
        tensors = {f"{module}.weight_packed": file_bytes(codes), f"{module}.weight_scale": scales}
        activations = {f"{module}.input_global_scale": torch.ones(1)}  # W4A4's: not needed, dropped
        return {**tensors, f"{module}.weight_global_scale": divisor, **activations}, meant
    codes, scales, meant = nvfp4(weight, largest / (448 * 6))  # ModelOpt: weight_scale_2 multiplies
    tensors = {name: file_bytes(codes), f"{module}.weight_scale": scales}
    return {
        **tensors,
        f"{module}.weight_scale_2": torch.tensor(largest / (448 * 6)),
        f"{module}.input_scale": torch.ones(()),
    }, meant


QUANTIZATION = {
    "gpt-oss": {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]},
    "modelopt": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]},
}


def quantization_config(layout: str) -> dict:
    if layout in QUANTIZATION:
        return QUANTIZATION[layout]
    group = 32 if layout.startswith("mxfp4") else 16
    weights = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": group, "symmetric": True}
    return {"quant_method": "compressed-tensors", "format": layout,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}  # fmt: skip


def write_checkpoint(hf, folder, layout: str, fused_experts: bool = False):
    """``hf`` saved to ``folder`` with its projections in ``layout`` (with ``fused_experts``, as gpt-oss
    stores them: ``experts.gate_up_proj`` [E, 2I, H] and ``experts.down_proj``); returns transformers' float
    model of the weights the quantized values stand for (saved in ``folder``/float)."""
    hf.save_pretrained(folder / "float", safe_serialization=True)
    tensors = load_file(folder / "float" / "model.safetensors")
    stored, meant_tensors = {}, dict(tensors)
    for name, tensor in tensors.items():
        if not (name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS):
            stored[name] = tensor
        elif not (fused_experts and ".experts." in name):
            parts, meant_tensors[name] = checkpoint_tensors(name, tensor, layout)
            stored.update(parts)
    if fused_experts:
        experts = sorted({n.split(".experts.")[0] for n in tensors if ".experts." in n})
        count = hf.config.num_experts
        for prefix in experts:
            gate_up = torch.stack([torch.cat([tensors[f"{prefix}.experts.{e}.{p}.weight"] for p in ("gate_proj", "up_proj")])
                                   for e in range(count)])  # fmt: skip
            down = torch.stack([tensors[f"{prefix}.experts.{e}.down_proj.weight"] for e in range(count)])
            for fused, weight in (("gate_up_proj", gate_up), ("down_proj", down)):
                parts, meant = checkpoint_tensors(f"{prefix}.experts.{fused}", weight, layout)
                stored.update(parts)
                for e in range(count):
                    if fused == "down_proj":
                        meant_tensors[f"{prefix}.experts.{e}.down_proj.weight"] = meant[e]
                    else:
                        gate, up = meant[e].chunk(2)
                        meant_tensors[f"{prefix}.experts.{e}.gate_proj.weight"] = gate
                        meant_tensors[f"{prefix}.experts.{e}.up_proj.weight"] = up
    save_file(stored, folder / "model.safetensors", metadata={"format": "pt"})
    save_file(meant_tensors, folder / "float" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "float" / "config.json").read_text())
    if layout == "modelopt":  # as ModelOpt's exports may name it: beside config.json
        quantization = {k: v for k, v in QUANTIZATION[layout].items() if k != "quant_method"}
        (folder / "hf_quant_config.json").write_text(json.dumps({"quantization": quantization}))
    else:
        config["quantization_config"] = quantization_config(layout)
    (folder / "config.json").write_text(json.dumps(config))
    return AutoModelForCausalLM.from_pretrained(folder / "float", attn_implementation="eager").float().eval()


def packed_weights(llm) -> list[QuantizedTensor]:
    model = llm.engine.model
    return [p for m in model.modules() for p in m.parameters(recurse=False) if isinstance(p, QuantizedTensor)]


# --- the formats' bytes -------------------------------------------------------------------------------


def test_mxfp4_blocks_are_an_e8m0_byte_then_16_bytes_of_codes():
    codes = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    scales = torch.randint(100, 140, (3, 2), dtype=torch.uint8)
    blocks = [
        torch.cat(
            [scales[:, b : b + 1], codes[:, 32 * b : 32 * b + 16] | (codes[:, 32 * b + 16 : 32 * b + 32] << 4)], 1
        )
        for b in range(2)
    ]  # value j of a block in the low nibble of its byte j, value j + 16 in the high one
    expected = E2M1[codes.long()] * torch.exp2(scales.float() - 127).repeat_interleave(32, dim=1)
    assert torch.equal(get_weight_format("mxfp4").dequantize(torch.cat(blocks, dim=1)), expected)


def test_nvfp4_blocks_are_a_float32_scale_8_e4m3_scales_then_64_bytes_of_codes():
    codes = torch.randint(0, 16, (2, 128), dtype=torch.uint8)
    scales = (torch.rand(2, 8) * 100).to(torch.float8_e4m3fn)
    tensor_scale = torch.tensor([[0.003], [7.5]])
    runs = [codes[:, 16 * s : 16 * s + 8] | (codes[:, 16 * s + 8 : 16 * s + 16] << 4) for s in range(8)]
    raw = torch.cat([tensor_scale.view(torch.uint8), scales.view(torch.uint8), *runs], dim=1)
    expected = E2M1[codes.long()] * (scales.float() * tensor_scale).repeat_interleave(16, dim=1)
    assert torch.equal(get_weight_format("nvfp4").dequantize(raw), expected)


def test_quantize_rounds_to_the_nearest_value_under_the_specs_scales():
    weight = torch.randn(4, 256) * torch.tensor([1e-3, 1.0, 50.0, 0.0])[:, None]
    _, _, meant = mxfp4(weight)
    fmt = get_weight_format("mxfp4")
    back = fmt.dequantize(fmt.quantize(weight))
    ties = weight.unflatten(-1, (-1, 32)) / (meant - back).unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True)
    assert torch.equal(back, meant) or torch.isinf(ties).any()  # equal but where a value sits on a midpoint
    fmt = get_weight_format("nvfp4")
    back = fmt.dequantize(fmt.quantize(weight))
    groups, errors = weight.unflatten(-1, (-1, 16)), (back - weight).unflatten(-1, (-1, 16))
    assert torch.all(errors.abs() <= groups.abs().amax(-1, keepdim=True) / 6 * 1.07)  # half the widest step, 4 to 6
    assert torch.equal(back[3], weight[3])


@pytest.mark.parametrize("layout", ["mxfp4-pack-quantized", "nvfp4-pack-quantized", "modelopt", "gpt-oss"])
def test_each_layout_loads_packed_as_the_values_it_stands_for(layout):
    weight = torch.randn(6, 256)
    tensors, meant = checkpoint_tensors("layer.proj.weight", weight, layout)
    (name, packed), *rest = decoded(iter(tensors.items()), decoder_for(quantization_config(layout)), torch.float32)
    assert name == "layer.proj.weight" and not rest and isinstance(packed, QuantizedTensor)
    assert packed.format.name == ("mxfp4" if layout in ("gpt-oss", "mxfp4-pack-quantized") else "nvfp4")
    torch.testing.assert_close(packed.dequantize(), meant, rtol=1e-6, atol=0)  # 1 / the global scale, rounded


def test_a_shape_that_contradicts_the_format_is_one_error_naming_the_tensor():
    tensors, _ = checkpoint_tensors("layer.proj.weight", torch.randn(6, 256), "nvfp4-pack-quantized")
    tensors["layer.proj.weight_scale"] = tensors["layer.proj.weight_scale"][:, :-1]
    with pytest.raises(ValueError, match=r"layer\.proj\.weight: NVFP4 codes \(6, 128\)"):
        list(decoded(iter(tensors.items()), decoder_for(quantization_config("nvfp4-pack-quantized")), torch.float32))
    nested = {"quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4", "group_size": 32}}
    with pytest.raises(ValueError, match="group_size 32"):
        decoder_for(nested)


# --- checkpoints --------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["mxfp4-pack-quantized", "modelopt"])  # and nvfp4-pack-quantized's experts below
def test_llama_checkpoint_stays_packed_and_computes_what_its_values_stand_for(layout, tmp_path, caplog):
    config = LlamaConfig(**WIDE, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    hf = save_tiny_model(config, tmp_path / "float")
    randomize(hf)
    hf = write_checkpoint(hf, tmp_path, layout)
    with caplog.at_level("INFO"):
        llm = LLM(model=str(tmp_path), dtype="float32", num_blocks=64)
    per_block = "17 bytes per 32 values" if layout.startswith("mxfp4") else "76 bytes per 128 values"
    assert f"kept 14 {'MXFP4' if layout.startswith('mxfp4') else 'NVFP4'} weights packed ({per_block})" in caplog.text
    weights = packed_weights(llm)
    assert len(weights) == 2 * 4  # per layer: the merged qkv, o, the merged gate/up, down
    assert {w.format.name for w in weights} == {"mxfp4" if layout.startswith("mxfp4") else "nvfp4"}
    bits = {"mxfp4": 4.25, "nvfp4": 4.75}  # what the model's memory holds (the file: 4.25 and 4.5)
    assert all(w.nbytes * 8 == w.logical_shape.numel() * bits[w.format.name] for w in weights)
    assert_greedy_tokens_and_logprobs_match(hf, llm, 11)


@pytest.mark.parametrize("layout", ["gpt-oss", "nvfp4-pack-quantized"])
def test_moe_experts_stay_packed(layout, tmp_path):
    config = Qwen3MoeConfig(
        **{**WIDE, "num_hidden_layers": 1}, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
        tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"],
    )  # fmt: skip
    hf = save_tiny_model(config, tmp_path / "float")
    randomize(hf)
    hf = write_checkpoint(hf, tmp_path, layout, fused_experts=layout == "gpt-oss")
    llm = LLM(model=str(tmp_path), dtype="float32", num_blocks=64)
    experts = [m for m in llm.engine.model.modules() if hasattr(m, "w13")]
    assert experts and all(isinstance(m.w13, QuantizedTensor) and isinstance(m.w2, QuantizedTensor) for m in experts)
    assert_greedy_tokens_and_logprobs_match(hf, llm, 11)


@pytest.mark.parametrize("isq", ["mxfp4", "nvfp4"])
def test_isq_packs_the_linears_of_a_float_checkpoint(isq, tmp_path):
    """Each row's blocks quantize on their own, so transformers' model with every matrix quantized and
    dequantized by the format is the float model of the packed weights (q/k/v and gate/up merged or not)."""
    config = LlamaConfig(**WIDE, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    hf = save_tiny_model(config, tmp_path)
    randomize(hf)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    llm = LLM(model=str(tmp_path), dtype="float32", num_blocks=64, isq=isq)
    linears = [m for m in llm.engine.model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.weight, QuantizedTensor) and m.weight.format.name == isq for m in linears)
    fmt = get_weight_format(isq)
    with torch.no_grad():
        for param in hf.parameters():
            if param.dim() == 2:  # the projections, the embeddings and the LM head
                param.copy_(fmt.dequantize(fmt.quantize(param)))
    assert_greedy_tokens_and_logprobs_match(hf, llm, 11)

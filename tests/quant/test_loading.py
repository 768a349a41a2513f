"""Packed weights at load: ISQ of a float checkpoint, GGUF files whose tensors contradict their type,
and checkpoints stored in a quantization xinfer does not load yet (FP8 and packed-integer ones load: test_quantized_checkpoint.py)."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from tests.tiny_models import COMMON, prefill_logits, prompt, save_tiny_model
from xinfer import LLM, SamplingParams
from xinfer.layers.linear import Linear
from xinfer.loading.errors import ModelFileError
from xinfer.loading.gguf_file import GGUFFile, GGUFFormatError
from xinfer.quant import QuantizedTensor


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), folder)
    return folder


@pytest.fixture(scope="module")
def float_logits(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32", num_blocks=64)
    return prefill_logits(llm.engine, prompt(24))


@pytest.mark.parametrize("isq, max_error", [("q8_0", 0.02), ("q4_0", 0.25)])
def test_isq_packs_every_linear_weight_and_generates(tiny_llama, float_logits, isq, max_error):
    llm = LLM(model=str(tiny_llama), dtype="float32", num_blocks=64, isq=isq)
    model = llm.engine.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.weight, QuantizedTensor) for m in linears)
    # the CPU backend repacks each at load into the layout its matmuls read
    assert {m.weight.format.name.split(":")[0] for m in linears} == {isq}
    assert isinstance(model.model.embed_tokens.weight, QuantizedTensor)
    logits = prefill_logits(llm.engine, prompt(24))
    error = float((logits - float_logits).abs().max() / float_logits.abs().max())
    assert error <= max_error, f"{isq}: max|diff|/max|logit| = {error:.3f}"
    out = llm.generate([prompt(12)], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8


def test_isq_to_a_format_it_cannot_quantize_to_is_one_error_naming_those_it_can(tiny_llama):
    with pytest.raises(ValueError, match=r"isq \(--isq\) 'iq2_xxs' is not a format .* choose one of .*q2_k.*, w2$"):
        LLM(model=str(tiny_llama), dtype="float32", num_blocks=64, isq="iq2_xxs")


def test_a_checkpoint_stored_quantized_is_refused_naming_its_method(tiny_llama, tmp_path):
    for file in tiny_llama.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFileError, match=r"quant_method 'bitsandbytes'\), which xinfer does not load yet"):
        LLM(model=str(tmp_path), dtype="float32", num_blocks=64)
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFileError, match=r"config\.json: quantization_config quant_method 'awq' with version "
                       r"'gemv' \(gemm is read\) is not read yet"):  # fmt: skip
        LLM(model=str(tmp_path), dtype="float32", num_blocks=64)


def _one_tensor_gguf(path, values: np.ndarray, qtype: gguf.GGMLQuantizationType) -> None:
    writer = gguf.GGUFWriter(path, "llama")
    data = gguf.quants.quantize(values, qtype)
    writer.add_tensor("blk.0.ffn_up.weight", data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _patch_layout(path, edit) -> None:
    """Rewrites the tensor's (n_dims, ne..., type) fields in the header with ``edit``."""
    data = bytearray(path.read_bytes())
    name = b"blk.0.ffn_up.weight"
    at = data.index(name) + len(name)
    dims = int.from_bytes(data[at : at + 4], "little")
    ne = [int.from_bytes(data[at + 4 + 8 * i : at + 12 + 8 * i], "little") for i in range(dims)]
    type_at = at + 4 + 8 * dims
    ne, qtype = edit(ne, int.from_bytes(data[type_at : type_at + 4], "little"))
    for i, n in enumerate(ne):
        data[at + 4 + 8 * i : at + 12 + 8 * i] = n.to_bytes(8, "little")
    data[type_at : type_at + 4] = qtype.to_bytes(4, "little")
    path.write_bytes(bytes(data))


def test_a_gguf_tensor_of_an_unknown_type_is_one_error_naming_it(tmp_path):
    path = tmp_path / "m.gguf"
    _one_tensor_gguf(path, np.ones((4, 64), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    assert GGUFFile(path).tensors["blk.0.ffn_up.weight"].ggml_type == gguf.GGMLQuantizationType.Q8_0
    _patch_layout(path, lambda ne, qtype: (ne, 250))
    with pytest.raises(
        GGUFFormatError, match=r"tensor 'blk.0.ffn_up.weight' has quantization type 250, which is unknown"
    ):
        GGUFFile(path)


def test_a_gguf_tensor_whose_shape_contradicts_its_type_is_one_error_naming_both(tmp_path):
    path = tmp_path / "m.gguf"
    _one_tensor_gguf(path, np.ones((4, 64), dtype=np.float32), gguf.GGMLQuantizationType.Q4_0)
    _patch_layout(path, lambda ne, qtype: ([48, *ne[1:]], qtype))
    with pytest.raises(
        GGUFFormatError, match=r"tensor 'blk.0.ffn_up.weight' of shape \(4, 48\) contradicts its type Q4_0"
    ):
        GGUFFile(path)


def test_a_tied_table_is_one_packed_parameter_for_lookups_and_logits(tmp_path):
    config = LlamaConfig(**COMMON, tie_word_embeddings=True, architectures=["LlamaForCausalLM"])
    save_tiny_model(config, tmp_path)
    float_logits = prefill_logits(LLM(model=str(tmp_path), dtype="float32", num_blocks=64).engine, prompt(16))
    llm = LLM(model=str(tmp_path), dtype="float32", num_blocks=64, isq="q8_0")
    model = llm.engine.model
    assert isinstance(model.lm_head.weight, QuantizedTensor) and model.lm_head.weight is model.model.embed_tokens.weight
    logits = prefill_logits(llm.engine, prompt(16))
    assert float((logits - float_logits).abs().max() / float_logits.abs().max()) <= 0.02


@pytest.fixture(scope="module")
def packed_moe(tmp_path_factory):
    """A tiny MiniMax-M2 (stacked experts) as a Q8_0 GGUF, and transformers' model holding exactly the values
    the file holds (quantized and dequantized by the gguf package)."""
    from tests.plugins.converted_gguf import checkpoint_tensors, write_converted_gguf
    from tests.plugins.hf_parity import randomize, spread_routing
    from tests.plugins.minimax.test_minimax_m2 import minimax_m2_config
    from tests.plugins.minimax.test_minimax_m2_gguf import metadata_writer

    folder = tmp_path_factory.mktemp("moe-q8")
    hf = save_tiny_model(minimax_m2_config(intermediate_size=64), folder)
    randomize(hf)
    spread_routing(hf)
    hf.save_pretrained(folder, safe_serialization=True)
    path = folder / "tiny-q8_0.gguf"
    q8 = gguf.GGMLQuantizationType.Q8_0
    write_converted_gguf(path, "minimax-m2", hf.config, checkpoint_tensors(folder), hf.config.num_hidden_layers,
                         metadata_writer(hf.config), quantize=q8)  # fmt: skip
    with torch.no_grad():
        for param in hf.parameters():
            if param.dim() >= 2 and param.shape[-1] % 32 == 0:
                values = gguf.quants.dequantize(gguf.quants.quantize(param.float().numpy(), q8), q8)
                param.copy_(torch.from_numpy(values))
    return hf, path


def test_packed_stacked_experts_match_transformers_on_the_files_values(packed_moe):
    from tests.loading.gguf_models import reference_llm
    from tests.plugins.hf_parity import assert_prefill_logits_match

    hf, path = packed_moe
    llm = reference_llm(path, dtype="float32", num_blocks=64)
    experts = [m for m in llm.engine.model.modules() if hasattr(m, "w13")]
    assert experts and all(isinstance(m.w13, QuantizedTensor) and isinstance(m.w2, QuantizedTensor) for m in experts)
    assert_prefill_logits_match(hf, llm, 29)
    fast = LLM(model=str(path), dtype="float32", num_blocks=64)  # the CPU backend's int8 path for the dense layers
    tokens = prompt(29)
    with torch.inference_mode():
        expected = hf(torch.tensor([tokens])).logits[0]
    error = float((prefill_logits(fast.engine, tokens) - expected).abs().max() / expected.abs().max())
    assert error <= 0.02, f"CPU fast path: max|diff|/max|HF logit| = {error:.2e}"

"""Checkpoints stored in FP8 e4m3 with their scales (DeepSeek/Qwen-FP8 blocks, compressed-tensors rows): each
weight is quantized here by the format's definition, and xinfer's model of the checkpoint must compute what
transformers' float model computes with the weights those FP8 values and scales stand for."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

from tests.plugins.hf_parity import assert_greedy_tokens_and_logprobs_match, assert_prefill_logits_match, randomize
from tests.tiny_models import COMMON, save_tiny_model
from xinfer import LLM

E4M3_MAX = 448.0
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BLOCKS = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 48]}
ROWS = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},
        }
    },
}


def fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` as e4m3 values in blocks of ``block`` (the edge ones partial), one scale a block taking its
    largest magnitude to 448: (values, scales, the weight they stand for)."""
    rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1])
    padded[:rows, :cols] = weight
    tiles = padded.view(grid[0], block[0], grid[1], block[1])
    scales = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12) / E4M3_MAX
    codes = (tiles / scales[:, None, :, None]).to(torch.float8_e4m3fn)
    meant = (codes.float() * scales[:, None, :, None]).view_as(padded)[:rows, :cols].contiguous()
    return codes.view_as(padded)[:rows, :cols].contiguous(), scales, meant


def fp8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scales = weight.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / E4M3_MAX
    codes = (weight / scales).to(torch.float8_e4m3fn)
    return codes, scales, codes.float() * scales


def write_fp8_checkpoint(hf, folder, quantization: dict):
    """``hf`` saved to ``folder`` with its projections in FP8 (``quantization`` says how); returns the reference:
    transformers' float model of the weights the FP8 values stand for (saved beside, in ``folder``/float)."""
    hf.save_pretrained(folder / "float", safe_serialization=True)
    tensors = load_file(folder / "float" / "model.safetensors")
    meant_tensors = dict(tensors)
    for name in [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in PROJECTIONS]:
        module = name.removesuffix(".weight")
        if quantization["quant_method"] == "fp8":
            codes, scales, meant = fp8_blocks(tensors[name].float(), tuple(quantization["weight_block_size"]))
            tensors[f"{module}.weight_scale_inv"] = scales
        else:
            codes, scales, meant = fp8_rows(tensors[name].float())
            tensors[f"{module}.weight_scale"] = scales
            tensors[f"{module}.input_scale"] = torch.ones(1)  # static activation scales: not needed, dropped
        tensors[name], meant_tensors[name] = codes, meant
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    save_file(meant_tensors, folder / "float" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "float" / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    return AutoModelForCausalLM.from_pretrained(folder / "float", attn_implementation="eager").float().eval()


def fp8_model(config, folder, quantization: dict):
    hf = save_tiny_model(config, folder / "float")
    randomize(hf)
    return write_fp8_checkpoint(hf, folder, quantization), LLM(model=str(folder), dtype="float32", num_blocks=64)


@pytest.mark.parametrize("quantization", [BLOCKS, ROWS], ids=["fp8-blocks-32x48", "compressed-tensors-rows"])
def test_fp8_checkpoint_computes_what_its_values_and_scales_stand_for(quantization, tmp_path):
    """hidden 64 and intermediate 160 in blocks of 32 x 48: partial blocks at the right and bottom edges."""
    config = LlamaConfig(**COMMON, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    hf, llm = fp8_model(config, tmp_path, quantization)
    assert_prefill_logits_match(hf, llm, 29)
    assert_greedy_tokens_and_logprobs_match(hf, llm, 11)


def test_fp8_experts_load_one_by_one(tmp_path):
    config = Qwen3MoeConfig(
        **{**COMMON, "hidden_size": 32, "intermediate_size": 64}, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=48, tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"],
    )  # fmt: skip
    hf, llm = fp8_model(config, tmp_path, BLOCKS)
    assert_greedy_tokens_and_logprobs_match(hf, llm, 11)


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp8")
    hf = save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), folder / "float")
    write_fp8_checkpoint(hf, folder, BLOCKS)
    return folder


def edited(fp8_folder, tmp_path, edit) -> str:
    for file in (f for f in fp8_folder.iterdir() if f.is_file()):
        (tmp_path / file.name).write_bytes(file.read_bytes())
    tensors = load_file(tmp_path / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    return str(tmp_path)


def test_an_fp8_weight_without_its_scale_is_named(fp8_folder, tmp_path):
    folder = edited(fp8_folder, tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight_scale_inv"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight: its FP8 tensors are incomplete"):
        LLM(model=folder, dtype="float32", num_blocks=64)


def test_scales_that_do_not_tile_the_weight_are_named(fp8_folder, tmp_path):
    def wrong_grid(tensors):
        tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"] = torch.ones(3, 3)

    with pytest.raises(ValueError, match=r"o_proj\.weight: scales \(3, 3\) do not tile \(64, 64\) values"):
        LLM(model=edited(fp8_folder, tmp_path, wrong_grid), dtype="float32", num_blocks=64)


def packed_integer_scheme(bits: int, group: int | None, symmetric: bool) -> dict:
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "dynamic": False,
               "strategy": "group" if group else "channel", "group_size": group}  # fmt: skip
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        "ignore": ["lm_head"],
    }


def write_packed_integer_checkpoint(hf, folder, quantization: dict):
    """``hf``'s projections compressed by compressed-tensors itself (llm-compressor's W4A16/W8A16 layout): its
    observers' scales and zero points, its quantize and pack; the reference is transformers' float model of
    the weights its own decompressor gives back."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(**quantization["config_groups"]["group_0"]["weights"])
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    hf.save_pretrained(folder / "float", safe_serialization=True)
    tensors = load_file(folder / "float" / "model.safetensors")
    meant_tensors = dict(tensors)
    for name in [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in PROJECTIONS]:
        module, weight = name.removesuffix(".weight"), tensors[name].float()
        columns = weight.unflatten(1, (-1, args.group_size)) if args.group_size else weight[:, None, :]
        scale, zero = calculate_qparams(columns.amin(-1), columns.amax(-1), args)
        state = {"weight": weight, "weight_scale": scale, "weight_zero_point": zero}
        compressed = PackedQuantizationCompressor.compress(state, scheme)
        meant_tensors[name] = PackedQuantizationCompressor.decompress(compressed, scheme)["weight"].contiguous()
        del tensors[name]
        tensors |= {f"{module}.{leaf}": value.contiguous() for leaf, value in compressed.items()}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    save_file(meant_tensors, folder / "float" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "float" / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    return AutoModelForCausalLM.from_pretrained(folder / "float", attn_implementation="eager").float().eval()


@pytest.mark.parametrize(
    "bits, group, symmetric",
    [(4, 32, True), (4, 16, False), (8, None, True)],
    ids=["w4-group32-symmetric", "w4-group16-zero-points", "w8-per-row"],
)
def test_packed_integer_checkpoint_computes_what_compressed_tensors_decompresses(bits, group, symmetric, tmp_path):
    config = LlamaConfig(**COMMON, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    hf = save_tiny_model(config, tmp_path / "float")
    randomize(hf)
    hf = write_packed_integer_checkpoint(hf, tmp_path, packed_integer_scheme(bits, group, symmetric))
    llm = LLM(model=str(tmp_path), dtype="float32", num_blocks=64)
    assert_prefill_logits_match(hf, llm, 29)
    assert_greedy_tokens_and_logprobs_match(hf, llm, 11)


def test_packed_integer_rows_that_end_inside_a_word(tmp_path):
    """down_proj's 100 columns take 13 words of eight 4-bit values, the last half empty: the weight is
    ``weight_shape``'s 100 columns, from the start-up's header-only build on."""
    config = LlamaConfig(**{**COMMON, "intermediate_size": 100}, tie_word_embeddings=False,
                         architectures=["LlamaForCausalLM"])  # fmt: skip
    hf = save_tiny_model(config, tmp_path / "float")
    randomize(hf)
    hf = write_packed_integer_checkpoint(hf, tmp_path, packed_integer_scheme(4, None, False))
    assert load_file(tmp_path / "model.safetensors")["model.layers.0.mlp.down_proj.weight_packed"].shape == (64, 13)
    llm = LLM(model=str(tmp_path), dtype="float32", num_blocks=64)
    assert_prefill_logits_match(hf, llm, 29)


@pytest.fixture(scope="module")
def w4_group16_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("w4")
    hf = save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), folder / "float")
    write_packed_integer_checkpoint(hf, folder, packed_integer_scheme(4, 16, False))
    return folder


def with_quantization(folder, tmp_path, edit) -> str:
    for file in (f for f in folder.iterdir() if f.is_file()):
        (tmp_path / file.name).write_bytes(file.read_bytes())
    fields = json.loads((tmp_path / "config.json").read_text())
    edit(fields["quantization_config"])
    (tmp_path / "config.json").write_text(json.dumps(fields))
    return str(tmp_path)


def test_a_group_size_that_contradicts_the_packed_scales_is_named(w4_group16_folder, tmp_path):
    def group_32(quantization):
        quantization["config_groups"]["group_0"]["weights"]["group_size"] = 32

    with pytest.raises(ValueError, match=r"down_proj\.weight: scales \(64, 10\) for \(64, 160\) values in groups of "
                       r"32 columns: \(64, 5\) expected"):  # fmt: skip
        LLM(model=with_quantization(w4_group16_folder, tmp_path, group_32), dtype="float32", num_blocks=64)


@pytest.mark.parametrize(
    "edit, named",
    [
        (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=3), "num_bits 3"),
        (lambda q: q.update(format="marlin-24"), "format 'marlin-24'"),
        (
            lambda q: q["config_groups"].update(group_1={"targets": ["re:.*down_proj"], "weights": {"num_bits": 8}}),
            "2 config_groups of different weights schemes",
        ),
    ],
    ids=["bits", "format", "two-schemes"],
)
def test_a_compressed_tensors_scheme_not_read_is_one_line_naming_it(w4_group16_folder, tmp_path, edit, named):
    with pytest.raises(ValueError, match=rf"config\.json: quantization_config .*{named}.* is not read yet"):
        LLM(model=with_quantization(w4_group16_folder, tmp_path, edit), dtype="float32", num_blocks=64)

"""AutoGPTQ and AutoAWQ 4-bit checkpoints: the test quantizes a tiny llama's projections in groups of 32 by the
formats' definition (``scale * (q - zero)``) and packs them as each format's specification lays them out (GPTQ:
``qweight`` along the input columns, zeros stored less one by subtracting 1 from each nibble of the word, with
the borrow a zero of 0 makes, ``g_idx``; AWQ: along the output rows in its
interleaved order); xinfer's model of the checkpoint must compute what transformers' float model of those values
computes (kept packed as Q4_1 where groups are whole blocks of 32, decoded at load under activation order)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.loading.gguf_models import reference_llm
from tests.plugins.hf_parity import assert_greedy_tokens_and_logprobs_match, assert_prefill_logits_match, randomize
from tests.quant.test_quantized_checkpoint import PROJECTIONS
from tests.tiny_models import COMMON, save_tiny_model
from xinfer.quant import QuantizedTensor

GROUP = 32
AWQ_PACK = [0, 2, 4, 6, 1, 3, 5, 7]  # the column (of 8) that nibble i of a word holds


def pack_low_first(values: torch.Tensor) -> torch.Tensor:
    """[R, 8W] values 0..15 -> [R, W] int32 words, value 8w + i in bits 4i."""
    words = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
    for i in range(8):
        words |= values[:, i::8].long() << (4 * i)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def quantize_groups(weight: torch.Tensor, group_of: torch.Tensor):
    """Asymmetric 4-bit per group of input columns (``group_of``: each column's group): q [N, K], scales and
    zeros [groups, N], and the weight they stand for."""
    groups = int(group_of.max()) + 1
    scales, zeros = torch.empty(groups, weight.shape[0]), torch.empty(groups, weight.shape[0])
    for g in range(groups):
        cols = weight[:, group_of == g]
        low, high = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        scales[g] = ((high - low) / 15).clamp_min(1e-6).half().float()
        zeros[g] = (-low / scales[g]).round().clamp(0, 15)
    q = (weight / scales.T[:, group_of] + zeros.T[:, group_of]).round().clamp(0, 15)
    return q, scales, zeros, scales.T[:, group_of] * (q - zeros.T[:, group_of])


def as_q4_1(q, scales, zeros, group_of):
    """The values Q4_1 holds for them: ``d * q + m``, ``m = -scale * zero`` rounded to fp16 (within that
    rounding of the format's values)."""
    offsets = (-scales * zeros).half().float()
    return scales.T[:, group_of] * q + offsets.T[:, group_of]


def as_gptq_v1(zeros: torch.Tensor) -> torch.Tensor:
    """Zeros [groups, N] packed less one as GPTQ v1 stores them: 0x11111111 subtracted from each word."""
    words = (pack_low_first(zeros).long() - 0x11111111) & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def gptq_tensors(weight, activation_order: bool):
    weight = weight.clone()
    weight[::3] = weight[::3].abs()  # no negative value in a third of the rows: their zeros are 0
    cols = weight.shape[1]
    order = torch.randperm(cols) if activation_order else torch.arange(cols)
    group_of = order // GROUP
    q, scales, zeros, meant = quantize_groups(weight, group_of)
    if not activation_order:  # kept packed as Q4_1
        meant = as_q4_1(q, scales, zeros, group_of)
    assert (zeros == 0).any() and (zeros > 0).any()
    stored = {"qweight": pack_low_first(q).T.contiguous(), "qzeros": as_gptq_v1(zeros),
              "scales": scales.half(), "g_idx": group_of.int()}  # fmt: skip
    return stored, meant


def awq_tensors(weight):
    group_of = torch.arange(weight.shape[1]) // GROUP
    q, scales, zeros, _ = quantize_groups(weight, group_of)
    meant = as_q4_1(q, scales, zeros, group_of)

    def interleaved(values):  # [R, C]: each 8 columns in AWQ's nibble order
        return values.unflatten(1, (-1, 8))[..., AWQ_PACK].flatten(1)

    stored = {"qweight": pack_low_first(interleaved(q.T)), "qzeros": pack_low_first(interleaved(zeros)),
              "scales": scales.half()}  # fmt: skip
    return stored, meant


CASES = {
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False}, False),
    "gptq-desc-act": ({"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": False}, True),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}, False),
}


def write_int4_checkpoint(folder, case: str):
    """A tiny llama in ``case``'s layout in ``folder``; returns transformers' float model of its values."""
    quantization, activation_order = CASES[case]
    config = LlamaConfig(**COMMON, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    hf = save_tiny_model(config, folder / "float")
    randomize(hf)
    hf.save_pretrained(folder / "float", safe_serialization=True)
    tensors = load_file(folder / "float" / "model.safetensors")
    meant_tensors = dict(tensors)
    for name in [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in PROJECTIONS]:
        module, weight = name.removesuffix(".weight"), tensors.pop(name).float()
        if case == "awq":
            stored, meant_tensors[name] = awq_tensors(weight)
        else:
            stored, meant_tensors[name] = gptq_tensors(weight, activation_order)
        tensors |= {f"{module}.{leaf}": value for leaf, value in stored.items()}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    save_file(meant_tensors, folder / "float" / "model.safetensors", metadata={"format": "pt"})
    fields = json.loads((folder / "float" / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**fields, "quantization_config": quantization}))
    return AutoModelForCausalLM.from_pretrained(folder / "float", attn_implementation="eager").float().eval()


@pytest.mark.parametrize("case", list(CASES))
def test_int4_checkpoint_computes_what_its_values_stand_for(case, tmp_path):
    reference = write_int4_checkpoint(tmp_path, case)
    llm = reference_llm(tmp_path, dtype="float32", num_blocks=64)  # not the CPU's bf16-activation int4 matmul
    packed = [p for p in llm.engine.model.parameters() if isinstance(p, QuantizedTensor)]
    assert bool(packed) != CASES[case][1]  # activation order: decoded at load
    assert all(p.format.name.startswith("q4_1") for p in packed)
    assert_prefill_logits_match(reference, llm, 29)
    assert_greedy_tokens_and_logprobs_match(reference, llm, 11)


def test_scales_that_contradict_the_packed_weight_are_named(tmp_path):
    write_int4_checkpoint(tmp_path, "awq")
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.scales"] = tensors["model.layers.1.mlp.down_proj.scales"][:, :8].clone()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight: awq tensors of shapes qweight "
                       r"\(160, 8\), qzeros \(5, 8\), scales \(5, 8\) do not make one 4-bit weight"):  # fmt: skip
        reference_llm(tmp_path, dtype="float32", num_blocks=64)


@pytest.mark.parametrize("case", ["gptq", "awq"])
def test_a_group_size_that_contradicts_the_scales_is_named(case, tmp_path):
    """Scales of 32-column groups under a config that says 64: GPTQ's g_idx would still decode them, AWQ's
    columns would read the first groups' scales; both are one error."""
    write_int4_checkpoint(tmp_path, case)
    fields = json.loads((tmp_path / "config.json").read_text())
    fields["quantization_config"]["group_size"] = 64
    (tmp_path / "config.json").write_text(json.dumps(fields))
    with pytest.raises(ValueError, match=rf"{case} tensors of shapes .* do not make one 4-bit weight in groups of 64"):
        reference_llm(tmp_path, dtype="float32", num_blocks=64)

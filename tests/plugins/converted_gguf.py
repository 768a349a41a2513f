"""A safetensors checkpoint written as a GGUF the way llama.cpp's converter (convert_hf_to_gguf.py) writes a
mixture-of-experts model: each projection's experts stacked into one [E, ., .] tensor, the router's
``e_score_correction_bias`` renamed ``e_score_correction.bias``, every name through gguf's own table, every
tensor F32. The caller writes the architecture's metadata."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import gguf
import torch
from safetensors.torch import load_file
from transformers import PretrainedConfig

_EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.(\w+)\.weight")


def checkpoint_tensors(folder: Path) -> dict[str, torch.Tensor]:
    return {name: t for file in sorted(folder.glob("*.safetensors")) for name, t in load_file(file).items()}


def stacked_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if match := _EXPERT.fullmatch(name):
            experts.setdefault(f"{match[1]}.{match[3]}.weight", {})[int(match[2])] = tensor
        else:
            out[name] = tensor
    for name, by_index in experts.items():
        out[name] = torch.stack([by_index[i] for i in range(len(by_index))])
    return out


def add_tiny_vocabulary(writer: gguf.GGUFWriter, vocab_size: int, pre: str | None = None) -> None:
    """A byte-level BPE vocabulary of placeholder tokens ``t``, ``0``, ``t0``, ``t1``... with the one merge
    ``t 0`` (llama.cpp refuses a BPE vocabulary without merges): prompts go in as token ids."""
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(["t", "0", *(f"t{i}" for i in range(vocab_size - 2))])
    writer.add_token_types([1] * vocab_size)
    writer.add_token_merges(["t 0"])


def write_converted_gguf(
    path: Path,
    arch: str,
    config: PretrainedConfig,
    tensors: dict[str, torch.Tensor],
    block_count: int,
    add_metadata: Callable[[gguf.GGUFWriter], None],
    quantize: gguf.GGMLQuantizationType | None = None,
) -> None:
    """``quantize``: matrices (and stacked experts) whose rows are whole blocks are written in that type,
    quantized by the gguf package, as llama.cpp's quantizer leaves norms and vectors in F32."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(block_count)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_used_count(config.num_experts_per_tok)
    add_metadata(writer)
    add_tiny_vocabulary(writer, config.vocab_size)
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), block_count)
    for name, tensor in stacked_experts(tensors).items():
        base, _, suffix = name.replace("e_score_correction_bias", "e_score_correction.bias").rpartition(".")
        gguf_base = names.get_name(base)
        assert gguf_base is not None, f"gguf's table has no {arch} name for {name}"
        values = tensor.float().numpy()
        block = gguf.GGML_QUANT_SIZES[quantize][0] if quantize is not None else 0
        if quantize is not None and values.ndim >= 2 and values.shape[-1] % block == 0:
            data = gguf.quants.quantize(values, quantize)
            writer.add_tensor(f"{gguf_base}.{suffix}", data, raw_shape=data.shape, raw_dtype=quantize)
        else:
            writer.add_tensor(f"{gguf_base}.{suffix}", values, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

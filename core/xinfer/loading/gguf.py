"""GGUF checkpoints: an HF config from the metadata, and tensors under HF checkpoint names.

Tensors in a block format xinfer registers (:mod:`xinfer.quant.gguf_formats`: Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1, Q2_K..Q6_K) stay packed, as :class:`xinfer.quant.QuantizedTensor` of the file's bytes;
the others (F32/F16/BF16, and quantized types without a format, as the IQ types: one log line)
are read as float32. What llama.cpp's converter changed on the way
from the HF checkpoint (a row permutation, an offset on norm weights...) is undone by the
architecture's :class:`GGUFAdapter`, which the plugin owning the architecture registers
through the ``xinfer_gguf_architectures`` hook; the core knows no architecture.
"""

from __future__ import annotations

import functools
import logging
import math
import re
from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm
from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from xinfer import registry
from xinfer.loading.errors import ModelFileError
from xinfer.loading.gguf_file import GGUFFile
from xinfer.loading.model_types import check_model_type
from xinfer.loading.overrides import overridden
from xinfer.model import convert
from xinfer.quant import WeightFormat, quantized, weight_formats

log = logging.getLogger(__name__)

# "<arch>.<key>" metadata -> HF config field, for keys every architecture spells the same
_CONFIG_FIELDS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "attention.sliding_window": "sliding_window",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}
# keys without which llama.cpp refuses a file (or cannot size its tensors): a transformers default must not stand in
_REQUIRED_KEYS = (
    "context_length",
    "embedding_length",
    "block_count",
    "attention.head_count",
    "attention.layer_norm_rms_epsilon",
)
# llama.cpp's divisor of each rotated pair's frequency, tensors read into the config: one at every context, or
# LongRoPE's pair (Phi-3), of which llama.cpp applies one at every position, chosen by the context it serves
ROPE_FREQS = "rope_freqs.weight"
LONGROPE_FACTORS = {"short": "rope_factors_short.weight", "long": "rope_factors_long.weight"}
_TOKEN_IDS = {"bos_token_id": "bos", "eos_token_id": "eos", "pad_token_id": "padding", "unk_token_id": "unknown"}


# HF field of a DeepSeek-style MoE config (DeepSeek V3, GLM-4.5) -> its "<arch>.<key>" metadata and type
DEEPSEEK_MOE_KEYS: dict[str, tuple[str, type]] = {
    "n_routed_experts": ("expert_count", int),
    "num_experts_per_tok": ("expert_used_count", int),
    "moe_intermediate_size": ("expert_feed_forward_length", int),
    "n_shared_experts": ("expert_shared_count", int),
    "first_k_dense_replace": ("leading_dense_block_count", int),
    "n_group": ("expert_group_count", int),
    "topk_group": ("expert_group_used_count", int),
    "routed_scaling_factor": ("expert_weights_scale", float),
    "norm_topk_prob": ("expert_weights_norm", bool),
}


# llama.cpp's reading of a DeepSeek-style MoE key the file lacks (transformers' defaults differ: a routed scaling of
# 2.5 and 3 dense layers for DeepSeek V3, renormalized weights and 1 dense layer for GLM-4.5)
DEEPSEEK_MOE_DEFAULTS: dict[str, Any] = {
    "n_group": 1,  # no group limit
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": False,
    "first_k_dense_replace": 0,
}


def read_fields(metadata: Mapping[str, Any], arch: str, keys: Mapping[str, tuple[str, type]]) -> dict[str, Any]:
    """The config fields of ``keys`` (field -> (key under ``arch``, type)) that the file writes."""
    return {
        field: kind(metadata[f"{arch}.{key}"]) for field, (key, kind) in keys.items() if f"{arch}.{key}" in metadata
    }


# llama.cpp's converters rename these parameters to a module's bias before the lookup
_CONVERTER_RENAMES = {"e_score_correction_bias": "e_score_correction.bias", "dt_bias": "dt_proj.bias"}


class GGUFAdapter:
    """How one GGUF architecture differs from the HF checkpoint it was converted from; as it stands, the
    identity: the GGUF stores the HF tensors unchanged. A plugin subclasses it to override what differs."""

    def __init__(self, model_type: str | None = None, names_as: str | None = None):
        self.model_type = model_type  # transformers' model_type; None: the GGUF architecture name
        # the gguf package's architecture whose tensor names the file's follow, where the package does not know
        # the file's own (llama.cpp's build can be newer than the package); None: the file's
        self.names_as = names_as

    def config(
        self, metadata: Mapping[str, Any], fields: dict[str, Any], tensor_names: Collection[str]
    ) -> dict[str, Any]:
        """Config fields to add or override, given the generic ``fields`` read so far and the names of the
        file's tensors (some settings, a bias say, show only as a tensor present or not)."""
        return {}

    def undo_conversion(self, hf_name: str, tensor: Tensor, config: PretrainedConfig) -> Tensor:
        """The HF checkpoint's value of tensor ``hf_name`` from its dequantized GGUF value."""
        return tensor

    def rope_freqs(self, divisors: list[float], fields: Mapping[str, Any]) -> dict[str, Any]:
        """Config fields of a file with llama.cpp's ``rope_freqs`` tensor: each rotated pair's frequency
        divided by its own factor (``divisors``) at every position (what the converter writes for Llama 3's
        ``llama3`` rope, metadata none). In HF's terms that is LongRoPE with those factors at every length and
        no attention scaling."""
        context = fields["max_position_embeddings"]
        scaling = {"rope_type": "longrope", "short_factor": divisors, "long_factor": divisors, "factor": 1.0,
                   "attention_factor": 1.0, "original_max_position_embeddings": context}  # fmt: skip
        return {"rope_scaling": scaling}

    def converter_name(self, hf_name: str) -> str:
        """The name llama.cpp's converter looks ``hf_name`` up by in gguf's table (it renames some
        parameters, a module's bias or weight, before the lookup)."""
        for old, new in _CONVERTER_RENAMES.items():
            hf_name = hf_name.replace(old, new)
        return hf_name


def gguf_adapter(architecture: str) -> GGUFAdapter:
    """The adapter a plugin registered for ``architecture``, else the identity."""
    adapters = registry.gguf_architectures()
    if architecture not in adapters:
        return GGUFAdapter()
    adapter = registry.load_registered(adapters[architecture])
    return adapter() if isinstance(adapter, type) else adapter


def load_gguf_config(
    path: str | Path, max_model_len: int | None = None, overrides: dict[str, Any] | None = None
) -> PretrainedConfig:
    """The HF config of the GGUF file at ``path`` (its fields in ``overrides`` replaced), served with a context of
    ``max_model_len`` tokens a sequence (None: the file's context_length), which decides the rope of a file with
    LongRoPE's factors."""
    registry.register_config_classes()
    file = GGUFFile(path)
    meta, arch = file.metadata, file.architecture
    _check_known(arch, file.path)
    adapter = gguf_adapter(arch)
    model_type = adapter.model_type or arch
    check_model_type(model_type, f"{file.path} (GGUF architecture {arch!r})")
    if missing := [f"{arch}.{key}" for key in _REQUIRED_KEYS if f"{arch}.{key}" not in meta]:
        raise ModelFileError(f"{file.path}: the metadata has no {', '.join(missing)}")
    fields: dict[str, Any] = {
        field: _plain(meta[f"{arch}.{key}"]) for key, field in _CONFIG_FIELDS.items() if f"{arch}.{key}" in meta
    }
    if "vocab_size" not in fields and "tokenizer.ggml.tokens" not in meta:
        raise ModelFileError(f"{file.path}: the metadata has no tokenizer.ggml.tokens (nor {arch}.vocab_size)")
    fields.setdefault("vocab_size", len(meta.get("tokenizer.ggml.tokens", ())))
    # the converter keeps a checkpoint's MTP layers after the decoder's, counted in block_count: skipped
    fields["num_hidden_layers"] -= int(meta.get(f"{arch}.nextn_predict_layers", 0))
    if fields.get("sliding_window") == 0:  # llama.cpp's "no window" (its converter writes it so for Phi-4)
        del fields["sliding_window"]
    for field, name in _TOKEN_IDS.items():
        if (token_id := meta.get(f"tokenizer.ggml.{name}_token_id")) is not None:
            fields[field] = int(token_id)
    if (scaling := _rope_scaling(meta, arch)) is not None:
        fields["rope_scaling"] = scaling
    # llama.cpp writes the output projection only when it is not the embedding matrix
    fields["tie_word_embeddings"] = "output.weight" not in file.tensors
    try:  # what the adapter cannot read, it says naming the metadata key; this names the file
        if ROPE_FREQS in file.tensors:
            fields.update(_rope_freqs_fields(file, adapter, fields, scaling))
        elif any(name in file.tensors for name in LONGROPE_FACTORS.values()):
            fields.update(_longrope_fields(file, fields, scaling, max_model_len or fields["max_position_embeddings"]))
        fields.update(adapter.config(meta, fields, file.tensors.keys()))
        fields.update(_one_value_each(fields, arch))
    except ModelFileError as error:
        raise ModelFileError(f"{file.path}: {error}") from None
    if "architectures" not in fields:
        fields["architectures"] = [_causal_lm_class(model_type, file.path)]
    return AutoConfig.for_model(model_type, **overridden(fields, overrides or {}))


def _one_value_each(fields: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """The fields llama.cpp reads as one value or one per layer (head counts, feed-forward length) that the file
    wrote per layer and no adapter took as such: one value where the layers agree, else one error naming the key."""
    values = {}
    for key in ("attention.head_count", "attention.head_count_kv", "feed_forward_length"):
        field = _CONFIG_FIELDS[key]
        per_layer = fields.get(field)
        if not isinstance(per_layer, list):
            continue
        if len(set(per_layer)) != 1:
            raise ModelFileError(f"{arch}.{key}: per-layer values {per_layer} differ, which xinfer reads only for "
                                 "architectures whose layers differ so (Gemma 4)")  # fmt: skip
        values[field] = per_layer[0]
    return values


def _check_known(arch: str, path: Path) -> None:
    """A GGUF architecture is read by a plugin's adapter, or is a model type transformers knows."""
    adapters = registry.gguf_architectures()
    if arch not in adapters and arch not in CONFIG_MAPPING:
        raise ModelFileError(
            f"{path}: GGUF architecture {arch!r} is known neither to transformers nor to an installed plugin "
            f"(those read {', '.join(sorted(adapters)) or 'none'}; xinfer plugins lists them, and a plugin adds one "
            f"with the xinfer_gguf_architectures hook)"
        )


def _plain(value: Any) -> Any:
    return value.tolist() if isinstance(value, np.ndarray) else value


def _rope_scaling(meta: Mapping[str, Any], arch: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or factor is None or float(factor) == 1.0:
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    if (context := meta.get(f"{arch}.rope.scaling.original_context_length")) is not None:
        scaling["original_max_position_embeddings"] = int(context)
    # The converter also writes YaRN's yarn_beta_fast/yarn_beta_slow/yarn_attn_factor where the checkpoint
    # sets them, but llama.cpp reads them for none of the architectures xinfer runs: it keeps its defaults
    # (betas 32 and 1, HF's too; the attention scale from the factor alone), and so does the config here.
    return scaling


def _rope_freqs_fields(file: GGUFFile, adapter: GGUFAdapter, fields: Mapping[str, Any], scaling: Any) -> dict[str, Any]:
    if scaling is not None:
        raise ModelFileError(f"both rope.scaling metadata and a {ROPE_FREQS} tensor; which one "
                             "llama.cpp's converter wrote for the model is unclear")  # fmt: skip
    return adapter.rope_freqs(dequantize(file, ROPE_FREQS).tolist(), fields)


def _longrope_fields(file: GGUFFile, fields: Mapping[str, Any], scaling: Any, served: int) -> dict[str, Any]:
    """LongRoPE as llama.cpp runs it (``llama_model::get_rope_factors``): the long factors at every position
    where the context served a sequence (``served``) is longer than the original context, else the short ones,
    whatever a sequence's own length (transformers switches by it); cos and sin times rope.scaling.attn_factor."""
    if scaling is not None:
        raise ModelFileError(f"both rope.scaling metadata and {' and '.join(LONGROPE_FACTORS.values())} tensors; "
                             "which one llama.cpp's converter wrote for the model is unclear")  # fmt: skip
    arch, context = file.architecture, fields["max_position_embeddings"]
    original = int(file.metadata.get(f"{arch}.rope.scaling.original_context_length", context))
    name = LONGROPE_FACTORS["long" if served > original else "short"]
    if name not in file.tensors:
        raise ModelFileError(f"{name}: the file has LongRoPE's other factors but not these, which llama.cpp "
                             f"applies for a context of {served} tokens (the original is {original})")  # fmt: skip
    divisors = dequantize(file, name).tolist()
    # both factor lists the chosen one: the rotary's per-length switch never fires
    scaling = {"rope_type": "longrope", "short_factor": divisors, "long_factor": divisors,
               "factor": context / original, "original_max_position_embeddings": original,
               "attention_factor": float(file.metadata.get(f"{arch}.rope.scaling.attn_factor", 1.0))}  # fmt: skip
    return {"rope_scaling": scaling, "original_max_position_embeddings": original}


def _causal_lm_class(model_type: str, path: Path) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelFileError(
            f"{path}: transformers knows no causal LM of model_type {model_type!r} and no plugin adapts the GGUF "
            f"architecture (a plugin names its class in the adapter's config(): 'architectures')"
        )
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]


def gguf_to_hf_names(
    architecture: str, config: PretrainedConfig, hf_names: Iterable[str], adapter: GGUFAdapter
) -> dict[str, str]:
    """GGUF tensor name -> HF checkpoint name: gguf's own table (HF -> GGUF), inverted
    over the checkpoint names the model expects (each renamed as the converter does: ``adapter``)."""
    names_as = adapter.names_as or architecture
    arch = next((a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == names_as), None)
    if arch is None:
        raise ValueError(f"the gguf package knows no architecture {names_as!r}")
    table = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    names = {}
    for hf_name in hf_names:
        renamed = adapter.converter_name(hf_name)
        base, dot, suffix = renamed.rpartition(".")
        if (gguf_base := table.get_name(base)) is not None:
            names[f"{gguf_base}{dot}{suffix}"] = hf_name
        elif (gguf_name := table.get_name(renamed)) is not None:  # a parameter of its own (A_log): no suffix
            names[gguf_name] = hf_name
    return names


def iter_gguf_weights(
    path: str | Path, config: PretrainedConfig, hf_names: Iterable[str], read: bool = True
) -> Iterator[tuple[str, Tensor]]:
    """Every tensor of the file that maps to one of ``hf_names`` (the checkpoint names
    the model loads) as (HF name, tensor), in file order: packed (:func:`read_tensor`) or float32;
    ``read`` False: the same on the meta device, from the header alone (:func:`header_tensor`)."""
    file = GGUFFile(path)
    adapter = gguf_adapter(file.architecture)
    names = gguf_to_hf_names(file.architecture, config, hf_names, adapter)
    formats = weight_formats()
    if not read:
        for name in [name for name in file.tensors if name in names]:
            conversion = functools.partial(adapter.undo_conversion, names[name], config=config)
            yield names[name], convert(header_tensor(file, name, formats), conversion)
        return
    unmapped = [n for n in file.tensors if n not in names and n != ROPE_FREQS and n not in LONGROPE_FACTORS.values()]
    # the blocks past the model's layers: MTP layers, which block_count counts and the adapter left out
    extra_layers = [n for n in unmapped if (block := _BLOCK.match(n)) and int(block[1]) >= config.num_hidden_layers]
    if extra_layers:
        log.info("%s: %d tensor(s) of the layers past the model's %d (MTP layers) are skipped",
                 file.path.name, len(extra_layers), config.num_hidden_layers)  # fmt: skip
    if unmapped := [n for n in unmapped if n not in extra_layers]:
        shown = ", ".join(unmapped[:5])
        log.warning("%s: %d tensor(s) have no HF counterpart and are skipped: %s", file.path.name, len(unmapped), shown)
    unpacked = Counter(info.ggml_type.name for n, info in file.tensors.items()
                       if n in names and info.ggml_type.name.lower() not in formats and info.ggml_type not in _FLOATS)  # fmt: skip
    if unpacked:
        shown = ", ".join(f"{kind} ({count} tensors)" for kind, count in sorted(unpacked.items()))
        log.info("%s: dequantized to float at load (no packed weight format registered for them): %s",
                 file.path.name, shown)  # fmt: skip
    for name in tqdm(file.tensors, desc=f"Loading {file.path.name}", unit="tensor"):
        if name in names:
            hf_name = names[name]
            conversion = functools.partial(adapter.undo_conversion, hf_name, config=config)
            yield hf_name, convert(read_tensor(file, name, formats), conversion)


_BLOCK = re.compile(r"blk\.(\d+)\.")
_FLOATS = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)


def read_tensor(file: GGUFFile, name: str, formats: Mapping[str, WeightFormat]) -> Tensor:
    """Tensor ``name`` of ``file``: kept packed where its type has a weight format in ``formats``,
    else float32."""
    info = file.tensors[name]
    format = formats.get(info.ggml_type.name.lower())
    if format is None or len(info.shape) < 2:
        return dequantize(file, name)
    raw = torch.from_numpy(np.array(file.raw(name)))  # a copy: the mmap is read-only
    return quantized(raw, format, info.shape, f"{file.path.name}: {name}")


def header_tensor(file: GGUFFile, name: str, formats: Mapping[str, WeightFormat]) -> Tensor:
    """What :func:`read_tensor` gives for tensor ``name``, on the meta device: its type and shape, no data."""
    info = file.tensors[name]
    format = formats.get(info.ggml_type.name.lower())
    if format is None or len(info.shape) < 2:
        return torch.empty(info.shape, dtype=torch.float32, device="meta")
    raw = torch.empty((*info.shape[:-1], info.nbytes // max(1, math.prod(info.shape[:-1]))), dtype=torch.uint8,
                      device="meta")  # fmt: skip
    return quantized(raw, format, info.shape, f"{file.path.name}: {name}")


def dequantize(file: GGUFFile, name: str) -> Tensor:
    values = gguf.quants.dequantize(file.raw(name), file.tensors[name].ggml_type)
    if not values.flags.writeable or values.dtype != np.float32:  # F32 is a view of the mmap
        values = values.astype(np.float32)
    return torch.from_numpy(values)

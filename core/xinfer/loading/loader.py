"""Build a model from its config and fill it with checkpoint or dummy weights."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, PretrainedConfig

from xinfer import registry
from xinfer.config import ModelConfig
from xinfer.layers.rotary import context_limit
from xinfer.loading.base_model import BaseModel, as_head_checkpoint, base_model, check_head
from xinfer.loading.errors import ModelFileError
from xinfer.loading.gguf import iter_gguf_weights, load_gguf_config
from xinfer.loading.legacy_names import current_names
from xinfer.loading.model_types import check_model_type
from xinfer.loading.overrides import overridden
from xinfer.loading.quantized_checkpoint import decoded, decoder_for
from xinfer.loading.safetensors import check_safetensors, header_tensors, iter_safetensors, safetensors_files
from xinfer.loading.stored import Weights
from xinfer.model import CausalLM, finish_loading
from xinfer.quant.isq import isq_mode, load_quantizer, quantizing_at_load, unallocated_weights


def load_config(
    path: Path, max_model_len: int | None = None, overrides: dict[str, Any] | None = None
) -> PretrainedConfig:
    """The model's config with the fields of ``overrides`` replaced (:func:`overridden`); ``max_model_len``: the
    context it serves a sequence, which a GGUF's LongRoPE factors are chosen by (None: the model's own)."""
    if path.suffix == ".gguf":
        return load_gguf_config(path, max_model_len, overrides)
    config = _hf_config(path, overrides)
    _refuse_quantized_checkpoint(config, path)
    if not _is_wrapper(config):
        return config
    text = config.text_config
    text.architectures = config.architectures or text.architectures  # the saved class: it reads the text part
    text.multimodal_config = config  # the wrapper (its encoders' configs, media token ids), for models that take them
    # transformers ties the wrapper's output embeddings by the wrapper's field (the text config's may differ)
    text.tie_word_embeddings = getattr(config, "tie_word_embeddings", False)
    return text


def quantization_config(config: PretrainedConfig) -> dict[str, Any] | None:
    """The checkpoint's ``quantization_config`` (on the model's config, its text part or its wrapper)."""
    for holder in (config, getattr(config, "text_config", None), getattr(config, "multimodal_config", None)):
        quantization = getattr(holder, "quantization_config", None)
        if quantization:
            return quantization if isinstance(quantization, dict) else vars(quantization)
    return None


def _refuse_quantized_checkpoint(config: PretrainedConfig, folder: Path) -> None:
    """A checkpoint stored in a quantization that no decoder here reads (bitsandbytes, HQQ, 3-bit GPTQ, ...)
    would load as garbage through the float path: refused in one line (:mod:`xinfer.loading.quantized_checkpoint`
    reads FP8, compressed-tensors' packed integers, GPTQ and AWQ)."""
    fields = quantization_config(config)
    try:
        if not fields or decoder_for(fields) is not None:
            return
    except ValueError as error:
        raise ModelFileError(f"{folder / 'config.json'}: {error}") from None
    method = fields.get("quant_method", "unnamed")
    detail = f", {fields['fmt']}" if "fmt" in fields else ""
    raise ModelFileError(
        f"{folder / 'config.json'}: the checkpoint is quantized (quantization_config quant_method {method!r}{detail}), "
        f"which xinfer does not load yet: use its bf16 checkpoint (quantize at load with --isq) or a GGUF file"
    )


def _hf_config(folder: Path, overrides: dict[str, Any] | None = None) -> PretrainedConfig:
    registry.register_config_classes()
    file = folder / "config.json"
    try:
        fields = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ModelFileError(f"{file}: not valid JSON: {error}") from None
    if not isinstance(fields, dict):
        raise ModelFileError(f"{file}: not a JSON object")
    if (model_type := fields.get("model_type")) is not None:
        check_model_type(model_type, str(file))
    try:
        config = AutoConfig.from_pretrained(folder)
        if overrides:
            config = type(config).from_dict(overridden(fields, overrides, type(config)))
    except (ValueError, OSError, TypeError, ArithmeticError, KeyError, StrictDataclassError) as error:  # a field
        kind = f"{type(error).__name__}: " if isinstance(error, ArithmeticError) else ""  # "division by zero" alone
        text = error.args[0] if isinstance(error, KeyError) and error.args else error  # (KeyError quotes its str)
        raise ModelFileError(f"{file}: {kind}{' '.join(str(text).split())}") from error
    modelopt = folder / "hf_quant_config.json"  # where ModelOpt's exports may name their quantization instead
    if modelopt.is_file() and not getattr(config, "quantization_config", None):
        quantization = json.loads(modelopt.read_text()).get("quantization") or {}
        config.quantization_config = {"quant_method": "modelopt", **quantization}
    return config


def check_model(path: Path, settings: ModelConfig | None = None) -> PretrainedConfig:
    """The model's config, its architecture found, its weight files there and readable and the ``settings``
    it is run with possible (the context length, the ``isq`` format): everything short of building the model
    and reading the weights, so that a bad model or setting fails in one line before anything starts."""
    settings = settings or ModelConfig()
    config = load_config(path, settings.max_model_len, settings.hf_overrides)
    if settings.mm_processor_kwargs:
        if getattr(config, "multimodal_config", None) is None:
            raise ValueError(f"{path}: the model takes no images: mm_processor_kwargs has no image processor to set")
        config.multimodal_config.mm_processor_kwargs = dict(settings.mm_processor_kwargs)
    try:
        registry.model_class(architecture_of(config))
        if (saved_base := _base_model_of(config)) is not None:
            check_head(config, saved_base)
    except ValueError as error:
        raise type(error)(f"{path}: {error}") from error
    for size in ("num_key_value_heads", "head_dim"):
        # a config class that leaves it None where none is given has no default: transformers' attention fails
        if size in vars(config) and vars(config)[size] is None:
            raise ModelFileError(f"{path}: the config's {size} is null: the attention needs its size")
    if settings.load_format != "dummy" and not reads_gguf(path, settings.load_format):
        check_safetensors(path)
    if settings.isq is not None:
        isq_mode(settings.isq)
    if (layers := getattr(config, "num_hidden_layers", 1)) < 1:
        raise ModelFileError(f"{path}: the config's num_hidden_layers is {layers}: a model has at least one layer")
    if settings.max_model_len is not None and settings.max_model_len > (limit := context_limit(config)):
        context = (
            f"max_position_embeddings ({limit})"
            if limit == config.max_position_embeddings
            else f"context under YaRN ({limit}: its original_max_position_embeddings times its factor)"
        )
        raise ValueError(f"max_model_len {settings.max_model_len} is more than the model's {context}: its positions "
                         "go no further (--max-model-len; a YaRN rope_scaling set with --hf-overrides scales them)")  # fmt: skip
    return config


def _is_wrapper(config: PretrainedConfig) -> bool:
    return getattr(config, "text_config", None) is not None and not getattr(config, "num_hidden_layers", None)


def architecture_of(config: PretrainedConfig) -> str:
    """The registered architecture that serves ``config``: the one it names, or the class with a head serving the
    base model it names (:mod:`xinfer.loading.base_model`)."""
    saved_base = _base_model_of(config)
    return saved_base.head if saved_base is not None else _named_architecture(config)


def _named_architecture(config: PretrainedConfig) -> str:
    architectures = getattr(config, "architectures", None) or []
    if not architectures:
        raise ModelFileError("the model config names no architecture (config.json lacks 'architectures')")
    if not isinstance(architectures, list):
        raise ModelFileError(f"the model config's 'architectures' is a list of class names, not {architectures!r}")
    return architectures[0]


def _base_model_of(config: PretrainedConfig) -> BaseModel | None:
    """The base model ``config`` names where no plugin registers it itself (its checkpoint is read as its head
    class's)."""
    named, registered = _named_architecture(config), set(registry.architectures())
    return None if named in registered else base_model(config, named, registered)


def build_model(config: PretrainedConfig, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """The model of ``config`` on ``device`` in ``dtype``, its parameters not filled yet (within
    :func:`xinfer.quant.isq.quantizing_at_load`: the weights to quantize not even allocated)."""
    cls = registry.model_class(architecture_of(config))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), unallocated_weights():
            model = cls(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def load_model(
    path: Path,
    config: PretrainedConfig,
    device: torch.device,
    dtype: torch.dtype,
    load_format: str,
    isq: str | None = None,
    release_cached: Callable[[], None] | None = None,
) -> CausalLM:
    """The model of ``config`` filled from ``path`` (or with dummy weights); with ``isq``, its weights
    quantized to that format as they load (:mod:`xinfer.quant.isq`). ``release_cached``: the device's
    (:func:`~xinfer.model.finish_loading`)."""
    mode = isq_mode(isq) if isq is not None else None  # a bad name fails before the weights load
    with quantizing_at_load(mode, device):
        model = build_model(config, device, dtype)
        if load_format == "dummy":
            init_dummy_weights(model)
        else:
            model.load_weights(_checkpoint_weights(path, load_format, model, dtype))
        if (quantizer := load_quantizer()) is not None:
            quantizer.finish(model)
    finish_loading(model, release_cached)
    return model


def _checkpoint_weights(
    path: Path, load_format: str, model: CausalLM, dtype: torch.dtype, read: bool = True
) -> Weights:
    """The checkpoint's tensors as ``model`` loads them (quantized ones decoded where it does not); ``read``
    False: on the meta device, from the files' headers."""
    weights = checkpoint_tensors(path, load_format, model, read)
    quantization = quantization_config(model.config)
    decoder = decoder_for(quantization) if quantization is not None else None
    if decoder is not None and not model.decodes_quantized_checkpoint:
        weights = decoded(weights, decoder, dtype)
    return weights


def held_model(path: Path, config: PretrainedConfig, dtype: torch.dtype, load_format: str,
               isq: str | None = None) -> CausalLM:  # fmt: skip
    """The model of ``config`` on the meta device as :func:`load_model` will hold it, loaded from the files'
    headers alone: each weight in ``dtype``, or packed where loading keeps the checkpoint's tensor packed (a GGUF
    type or a ``quantization_config`` with a weight format, a module that keeps it so) or ``isq`` packs it."""
    meta = torch.device("meta")
    with _quiet(), quantizing_at_load(isq_mode(isq) if isq is not None else None, meta):
        model = build_model(config, meta, dtype)
        quantizer = load_quantizer()
        if load_format == "dummy":
            if quantizer is not None:
                for module, name in quantizer.targets(model):
                    quantizer.allocate(model, module, name)
                    quantizer.quantize(model, module, name)
        else:
            model.load_weights(_checkpoint_weights(path, load_format, model, dtype, read=False))
        if quantizer is not None:
            quantizer.finish(model)
    finish_loading(model)
    return model


class _LinesOfThread(logging.Filter):
    """Drops the warning lines (and below) that the thread which made it logs; other threads' pass."""

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.WARNING or record.thread != self.thread


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No info or warning lines from this thread (what loading kept, skipped or decoded, from the core's loggers or
    a plugin's): the load that reads the files says them, once. The filter sits on the root logger's handlers, where
    every logger's lines arrive; the server's other threads (its requests, /health) still log meanwhile."""
    quiet, handlers = _LinesOfThread(), list(logging.root.handlers)
    for handler in handlers:
        handler.addFilter(quiet)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(quiet)


def checkpoint_tensors(path: Path, load_format: str, model: CausalLM, read: bool = True) -> Weights:
    """The checkpoint's tensors by HF name; ``read`` False: on the meta device, from the files' headers."""
    if reads_gguf(path, load_format):
        return iter_gguf_weights(path, model.config, model.checkpoint_names(), read)
    weights = iter_safetensors(path) if read else header_tensors(path)
    saved_base = _base_model_of(model.config)
    return current_names(weights if saved_base is None else as_head_checkpoint(weights, saved_base))


def checkpoint_bytes(path: Path) -> int:
    """The size of the model's weight files (a GGUF file, or an HF folder's safetensors)."""
    files = [path] if path.suffix == ".gguf" else safetensors_files(path)
    return sum(file.stat().st_size for file in files)


def reads_gguf(path: Path, load_format: str) -> bool:
    """Whether the weights are read from a GGUF file (else from the folder's safetensors)."""
    is_gguf = path.suffix == ".gguf"
    if load_format in ("auto", "gguf" if is_gguf else "safetensors"):
        return is_gguf
    raise ModelFileError(f"load_format (--load-format) {load_format!r} cannot read {path}: it is "
                         f"{'a GGUF file' if is_gguf else 'an HF folder'}")  # fmt: skip


def init_dummy_weights(model: CausalLM, seed: int = 0) -> None:
    """Random weights of the right shapes (for benchmarks): matrices ~ N(0, 0.02),
    vectors (norms, biases) ~ 1 + N(0, 0.02); integer tables (a hash router's) kept as built.
    Drawn in pieces of 2**26 values, so a stacked expert tensor needs no float32 copy of its size;
    with ``--isq``, each weight quantized once drawn."""
    quantizer = load_quantizer()
    device = quantizer.device if quantizer is not None else next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    drawn: set[int] = set()  # a tied weight is drawn once
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) in drawn:
                continue
            if quantizer is not None:
                quantizer.allocate(model, module, name)
                param = getattr(module, name)
            if param.dtype.is_floating_point:
                mean = 1.0 if param.dim() == 1 else 0.0
                for piece in param.data.view(-1).split(2**26):
                    noise = torch.randn(piece.shape, generator=generator, device=piece.device, dtype=torch.float32)
                    piece.copy_(noise.mul_(0.02).add_(mean))
            if quantizer is not None:
                quantizer.quantize(model, module, name)
            drawn.add(id(getattr(module, name)))

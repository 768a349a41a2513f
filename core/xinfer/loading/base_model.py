"""Checkpoints of transformers' base model of a model type (``LlamaModel``, ``Qwen3_5Model``: the decoder, and any
encoders, without the LM head), served as transformers serves them: by the class of the model type that has a head
(transformers' image-text-to-text class, else its causal-LM class), the checkpoint's tensors under that class's
``base_model_prefix``, the LM head the tied input embeddings."""

from __future__ import annotations

from dataclasses import dataclass

import transformers
from transformers import PretrainedConfig
from transformers.models.auto import modeling_auto

from xinfer.loading.errors import ModelFileError
from xinfer.loading.stored import Weights

_HEAD_CLASSES = (
    modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
)


@dataclass(frozen=True)
class BaseModel:
    """``name``: the base model's class the checkpoint was saved from; ``head``: the class serving it."""

    name: str
    head: str

    @property
    def prefix(self) -> str:
        """Where the head class keeps the base model (its tensors' names start with it)."""
        return str(getattr(transformers, self.head).base_model_prefix)


def base_model(config: PretrainedConfig, architecture: str, registered: set[str]) -> BaseModel | None:
    """The base model that ``architecture`` (``config.json``'s) names and the registered head class serving it;
    None where it names no base model, or one of a model type no registered class serves (the caller then names
    the architecture as unknown)."""
    for holder in (getattr(config, "multimodal_config", None), config):  # an image-text model's wrapper first
        model_type = getattr(holder, "model_type", None)
        if model_type is None or modeling_auto.MODEL_MAPPING_NAMES.get(model_type) != architecture:
            continue
        heads = [table[model_type] for table in _HEAD_CLASSES if table.get(model_type) in registered]
        return BaseModel(architecture, heads[0]) if heads else None
    return None


def check_head(config: PretrainedConfig, model: BaseModel) -> None:
    """A base model's checkpoint computes logits only through its tied input embeddings: refused in one line
    where the config does not tie them (transformers would draw a random head)."""
    if not getattr(config, "tie_word_embeddings", False):
        raise ModelFileError(
            f"config.json names {model.name}, transformers' base model without an LM head, and does not tie the "
            f"word embeddings (tie_word_embeddings false): nothing computes its logits; save it as {model.head}"
        )


def as_head_checkpoint(weights: Weights, model: BaseModel) -> Weights:
    """The base model's tensors under the head class's names."""
    prefix = f"{model.prefix}."
    return ((name if name.startswith(prefix) else prefix + name, tensor) for name, tensor in weights)

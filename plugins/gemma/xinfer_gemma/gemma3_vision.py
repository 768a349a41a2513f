"""Gemma 3 with images (``Gemma3ForConditionalGeneration``): the text model of
:mod:`xinfer_gemma.gemma3`, a SigLIP encoder, and the projector into the text model's space.

An image becomes ``mm_tokens_per_image`` soft tokens: SigLIP's patches (``image_size /
patch_size`` per side) average-pooled to ``sqrt(mm_tokens_per_image)`` per side, RMS-normed
(``1 + w``) and projected. In the prompt, each ``<start_of_image>`` becomes ``"\\n\\n"``,
``<start_of_image>``, the image's soft tokens, ``<end_of_image>``, ``"\\n\\n"``, as transformers'
processor writes it (into the text, where the tokenizer joins them with newlines beside them: here
their tokens merge); the soft tokens of one image attend to each other both ways. Pan and scan
(cropping wide images into several) is off, as in transformers' processor unless a call asks it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor, nn

from xinfer import ops
from xinfer.layers import RMSNorm
from xinfer.loading.stored import StoredTensor, Weights
from xinfer.multimodal import MultiModalItem
from xinfer.multimodal.image import (
    Normalization,
    image_hash,
    preprocessor_config,
    processor_config,
    resize,
    to_rgb,
)
from xinfer_gemma.gemma3 import Gemma3ForCausalLM
from xinfer_gemma.siglip import SiglipVisionTransformer

SIGLIP = Normalization(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))


class Gemma3Projector(nn.Module):
    """Patches [B, P, vision] -> soft tokens [B, mm_tokens_per_image, hidden]."""

    def __init__(self, config: Any):
        super().__init__()
        vision = config.vision_config
        self.patches_per_side = vision.image_size // vision.patch_size
        self.pool = self.patches_per_side // int(config.mm_tokens_per_image**0.5)
        if self.pool == 0 or (self.patches_per_side // self.pool) ** 2 != config.mm_tokens_per_image:
            raise ValueError(
                f"mm_tokens_per_image={config.mm_tokens_per_image} is not the square of a side that "
                f"{self.patches_per_side} patches a side pool to (image_size {vision.image_size} / patch_size "
                f"{vision.patch_size}): the encoder would yield another number of soft tokens"
            )
        self.mm_soft_emb_norm = RMSNorm(vision.hidden_size, vision.layer_norm_eps, weight_offset=1.0)
        # stored [hidden, vision] (a linear's layout); the checkpoint's is [vision, hidden]
        self.mm_input_projection_weight = nn.Parameter(torch.empty(config.text_config.hidden_size, vision.hidden_size))

    def forward(self, patches: Tensor) -> Tensor:
        side = self.patches_per_side
        grid = patches.transpose(1, 2).unflatten(2, (side, side))  # [B, vision, side, side]
        pooled = F.avg_pool2d(grid, self.pool).flatten(2).transpose(1, 2)  # [B, tokens, vision]
        normed = self.mm_soft_emb_norm(pooled.flatten(0, 1))
        return ops.linear(normed, self.mm_input_projection_weight).unflatten(0, pooled.shape[:2])

    def from_checkpoint(self, name: str, tensor: Tensor) -> Tensor:
        return tensor.t().contiguous() if name == "mm_input_projection_weight" else tensor


class Gemma3ImageProcessor:
    """Images -> SigLIP's input: RGB, resized to ``image_size`` square (bilinear), ``/ 255``,
    normalised by mean and std 0.5; the checkpoint's ``preprocessor_config.json`` may name
    another filter (``resample``) and scaling."""

    def __init__(self, config: Any, tokenizer: Any):
        self.config = config
        self.image_size = config.vision_config.image_size
        preprocessor = preprocessor_config(config)
        refuse_unencodable_settings(preprocessor, self.image_size)
        refuse_another_image_length(processor_config(config), config.mm_tokens_per_image)
        self.resample = preprocessor.get("resample", "bilinear")
        self.convert_rgb = preprocessor.get("do_convert_rgb", True)
        self.normalization = Normalization.from_preprocessor(preprocessor, SIGLIP)
        self.placeholders = {"image": config.boi_token_index}
        self.merges = newline_merges(tokenizer) if tokenizer is not None else {}
        newlines = tokenizer.encode("\n\n", add_special_tokens=False) if tokenizer is not None else []
        soft = [config.image_token_index] * config.mm_tokens_per_image
        self._tokens = [*newlines, config.boi_token_index, *soft, config.eoi_token_index, *newlines]
        self._start = len(newlines) + 1

    def process(self, modality: str, data: Any) -> MultiModalItem:
        if not isinstance(data, Image.Image):
            raise ValueError(f"an image must be a PIL image, got {type(data).__name__}")
        pixels = self.normalization(
            resize(to_rgb(data, self.convert_rgb), self.image_size, self.image_size, self.resample)
        )
        return MultiModalItem("image", image_hash(data), {"pixel_values": pixels}, self.config.mm_tokens_per_image)

    def replacement(self, item: MultiModalItem) -> tuple[list[int], int]:
        return list(self._tokens), self._start


def refuse_unencodable_settings(preprocessor: Mapping[str, Any], image_size: int) -> None:
    """One error where the checkpoint's image processor would hand SigLIP images of another size than its
    ``image_size`` (transformers' encoder then fails on its position embeddings)."""
    if not preprocessor.get("do_resize", True):
        raise ValueError("the image processor's do_resize is false: images would reach the encoder at their own size")
    size = preprocessor.get("size", {"height": image_size, "width": image_size})
    if (size.get("height"), size.get("width")) != (image_size, image_size):
        raise ValueError(
            f"the image processor's size {size} is not the vision config's image_size ({image_size}) a side"
        )


def refuse_another_image_length(processor: Mapping[str, Any], mm_tokens_per_image: int) -> None:
    """One error where the checkpoint's processor writes another number of soft tokens per image than the encoder
    yields (transformers' model then refuses every image)."""
    if processor.get("image_seq_length", mm_tokens_per_image) != mm_tokens_per_image:
        raise ValueError(
            f"the processor's image_seq_length ({processor['image_seq_length']}) is not the config's "
            f"mm_tokens_per_image ({mm_tokens_per_image})"
        )


def newline_merges(tokenizer: Any, longest: int = 31) -> dict[tuple[int, int], int]:
    """The tokenizer's tokens of runs of newlines (Gemma's has one for each run up to 31), as the pairs that
    make a longer run: transformers' processor writes ``"\\n\\n"`` around an image into the text, where it
    joins the newlines beside it into one token."""
    runs = {}
    for n in range(1, longest + 1):
        ids = tokenizer.encode("\n" * n, add_special_tokens=False)
        if len(ids) == 1 and tokenizer.decode(ids) == "\n" * n:
            runs[n] = ids[0]
    return {(runs[a], runs[b]): runs[a + b] for a in runs for b in runs if a + b in runs}


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma 3's text model with its SigLIP encoder; its logits not soft-capped, whatever the text config's
    ``final_logit_softcapping`` says, as transformers' Gemma3ForConditionalGeneration leaves them."""

    attend_within_items: ClassVar[bool] = True

    def __init__(self, config: Any):
        wrapper = config.multimodal_config  # the loader hands the text config, the wrapper's beside it
        super().__init__(config)
        self.lm_head.softcap = None
        self.wrapper_config = wrapper
        self.vision_tower = SiglipVisionTransformer(wrapper.vision_config)
        self.multi_modal_projector = Gemma3Projector(wrapper)

    def multimodal_processor(self, tokenizer: Any) -> Gemma3ImageProcessor:
        return Gemma3ImageProcessor(self.wrapper_config, tokenizer)

    def encode(self, modality: str, items: Sequence[MultiModalItem]) -> list[Tensor]:
        dtype = self.multi_modal_projector.mm_input_projection_weight.dtype
        device = self.multi_modal_projector.mm_input_projection_weight.device
        pixels = torch.stack([item.data["pixel_values"] for item in items]).to(device, dtype)
        return list(self.multi_modal_projector(self.vision_tower(pixels)))

    def load_weights(self, weights: Weights) -> set[str]:
        return super().load_weights(_renamed(weights))


def _renamed(weights: Weights) -> Iterator[tuple[str, Tensor | StoredTensor]]:
    """Checkpoint names as this model's: transformers writes the parts as ``model.language_model.``,
    ``model.vision_tower.vision_model.``, ``model.multi_modal_projector.`` and, in older checkpoints and
    what it saves, ``language_model.model.``, ``vision_tower.``, ``multi_modal_projector.``."""
    for name, tensor in weights:
        if name.startswith(("model.language_model.", "model.vision_tower.", "model.multi_modal_projector.")):
            name = name.removeprefix("model.")
        if name.startswith("language_model."):
            name = name.removeprefix("language_model.")
            name = name if name.startswith(("model.", "lm_head.")) else "model." + name
        elif name.startswith("vision_tower.vision_model."):
            name = "vision_tower." + name.removeprefix("vision_tower.vision_model.")
        yield name, tensor

"""Qwen3-VL (dense and MoE) and the vision part of Qwen3.5 / Qwen3.6: a Qwen text model whose
image tokens take the vision encoder's embeddings (:mod:`xinfer_qwen.vl_vision`), with
multimodal rotary positions (:mod:`xinfer_qwen.mrope`) and, in Qwen3-VL, DeepStack: the
features of chosen encoder blocks added to the hidden states of the first decoder layers at the
image tokens.

A prompt marks each image with one ``<|image_pad|>`` between ``<|vision_start|>`` and
``<|vision_end|>`` (as the chat template writes it); the processor expands it to one token per
merged 2x2 patch group. An image advances the positions by ``max(rows, columns)`` of its
merged grid, not by its token count (``MultiModalItem.num_positions``): the engine gives the
model each token's time position, and the model derives the rows and columns of image tokens
from the step's slices.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import torch
from PIL import Image
from torch import Tensor, nn

from xinfer.forward_context import multimodal
from xinfer.layers import DecoderForCausalLM, MoE, RotaryEmbedding, Routing, rope_parameters
from xinfer.loading.stored import StoredTensor, Weights, whole
from xinfer.multimodal import MultiModalEmbeddings, MultiModalItem
from xinfer.multimodal.image import image_hash, preprocessor_config
from xinfer_qwen.mrope import MRotaryEmbedding
from xinfer_qwen.qwen import Qwen3ForCausalLM
from xinfer_qwen.qwen3_next import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, text_model
from xinfer_qwen.qwen_moe import Qwen3MoeForCausalLM, is_sparse
from xinfer_qwen.vl_image import ImageSpec, num_tokens, patchify, pixels
from xinfer_qwen.vl_vision import VisionEncoder


class QwenImageProcessor:
    """Images to the vision encoder's patches (:mod:`xinfer_qwen.vl_image`), one item each."""

    def __init__(self, image_token_id: int, spec: ImageSpec):
        self.placeholders = {"image": image_token_id}
        self.merges: dict[tuple[int, int], int] = {}
        self.spec = spec

    def process(self, modality: str, data: Any) -> MultiModalItem:
        if not isinstance(data, Image.Image):
            raise ValueError(f"an image must be a PIL image, got {type(data).__name__}")
        image = pixels(data, self.spec)  # patched on the device: the patches repeat it temporal_patch_size times
        grid = (1, image.shape[1] // self.spec.patch_size, image.shape[2] // self.spec.patch_size)
        return MultiModalItem("image", image_hash(data), {"pixels": image}, num_tokens(grid, self.spec),
                              extra={"grid": grid}, num_positions=max(grid[1:]) // self.spec.merge_size)  # fmt: skip

    def replacement(self, item: MultiModalItem) -> tuple[list[int], int]:
        return [self.placeholders["image"]] * item.num_embeddings, 0


class QwenVisionLanguage(DecoderForCausalLM):
    """What the vision-language models add to their Qwen text model; a class lists it before
    the text model's class (``class Qwen3VL(QwenVisionLanguage, Qwen3ForCausalLM)``)."""

    attend_within_items: ClassVar[bool] = False
    default_mrope_section: ClassVar[tuple[int, int, int]] = (24, 20, 20)  # where the rope parameters name none
    deepstack: ClassVar[bool] = True

    def __init__(self, config: Any):
        wrapper = config.multimodal_config  # the loader hands the text config, the wrapper's beside it
        super().__init__(config)
        if wrapper.vision_config.out_hidden_size != config.hidden_size:
            raise ValueError(f"vision_config out_hidden_size {wrapper.vision_config.out_hidden_size} is not the text "
                             f"model's hidden_size {config.hidden_size}: image embeddings take the place of tokens'")  # fmt: skip
        self.visual = VisionEncoder(wrapper.vision_config, self.deepstack)
        self.merge_size = wrapper.vision_config.spatial_merge_size
        self.image_token_id = wrapper.image_token_id
        self.image_spec = ImageSpec.from_configs(wrapper.vision_config, preprocessor_config(wrapper))

    def layer(self, config: Any, index: int, rotary: RotaryEmbedding) -> nn.Module:
        sections = rope_parameters(config).get("mrope_section", self.default_mrope_section)
        return super().layer(config, index, MRotaryEmbedding(rotary, sections))

    def multimodal_processor(self, tokenizer: Any) -> QwenImageProcessor:
        return QwenImageProcessor(self.image_token_id, self.image_spec)

    def encode(self, modality: str, items: Sequence[MultiModalItem]) -> list[Tensor]:
        """Each image's merged embeddings, DeepStack levels beside them: [tokens, out_hidden * levels]."""
        device = self.visual.pos_embed.weight.device
        patches = torch.cat([patchify(item.data["pixels"].to(device), self.image_spec)[0] for item in items])
        out = self.visual(patches, [item.extra["grid"] for item in items])
        return list(out.split([item.num_embeddings for item in items]))

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        model, images = self.model, multimodal()
        h, residual = model.embed_tokens(input_ids), None
        deepstack: list[Tensor] = []
        if images is not None:
            main, *deepstack = images.embeddings.to(h.dtype).chunk(self.visual.levels, dim=-1)
            h = h.index_copy(0, images.rows, main)
            positions = self.image_positions(positions, images)
        for index, layer in enumerate(model.layers):
            h, residual = layer(positions, h, residual)
            if index < len(deepstack):
                assert images is not None
                h = h.index_add(0, images.rows, deepstack[index])
        h, _ = model.norm(h, residual)
        return h

    def image_positions(self, positions: Tensor, images: MultiModalEmbeddings) -> Tensor:
        """Three positions per token [3, T]: the engine's ``positions`` on every axis, but token
        ``j`` of an image from position ``s`` on a merged grid ``w`` wide (the engine gives it
        ``s + j``) is at time ``s``, row ``s + j // w`` and column ``s + j % w``."""
        index: list[int] = []
        width: list[int] = []
        for piece in images.slices:
            columns = piece.range.item.extra["grid"][2] // self.merge_size
            index += range(piece.first, piece.last)
            width += [columns] * (piece.last - piece.first)
        j, w = torch.tensor([index, width], device=positions.device)
        start = positions[images.rows] - j
        three = positions.expand(3, -1).clone()
        three[0, images.rows] = start
        three[1, images.rows] = start + j // w
        three[2, images.rows] = start + j % w
        return three

    def load_weights(self, weights: Weights) -> set[str]:
        return super().load_weights(renamed(weights))


def renamed(weights: Weights) -> Iterator[tuple[str, Tensor | StoredTensor]]:
    """transformers' names (``model.language_model.``, ``model.visual.``) as this model's."""
    for name, tensor in text_model(weights):
        yield (name.removeprefix("model.") if name.startswith("model.visual.") else name), tensor


class Qwen3VLForConditionalGeneration(QwenVisionLanguage, Qwen3ForCausalLM):
    """Qwen3-VL: Qwen3's text model."""


class Qwen3VLMoeForConditionalGeneration(QwenVisionLanguage, Qwen3MoeForCausalLM):
    """Qwen3-VL-MoE: Qwen3-MoE's text model, its router's top-k weights always renormalized, its
    experts stored fused: released checkpoints hold ``gate_up_proj`` [E, hidden, 2I] and
    ``down_proj`` [E, I, hidden], transformers 5 saves them transposed; both load (a square one as
    transformers reads it: in its own layout)."""

    def mlp(self, config: Any, index: int) -> nn.Module:
        if not is_sparse(config, index):
            return DecoderForCausalLM.mlp(self, config, index)
        routing = Routing(top_k=config.num_experts_per_tok, renormalize=True)
        return MoE(config.hidden_size, config.num_experts, config.moe_intermediate_size, routing, config.hidden_act)

    def load_weights(self, weights: Weights) -> set[str]:
        hidden, inner = self.config.hidden_size, self.config.moe_intermediate_size
        released = {"experts.gate_up_proj": (hidden, 2 * inner), "experts.down_proj": (inner, hidden)}

        def model_layout(name: str, tensor: Tensor | StoredTensor) -> Tensor | StoredTensor:
            layout = next((shape for suffix, shape in released.items() if name.endswith(suffix)), None)
            if layout is None or tensor.shape[1:] != layout or layout[0] == layout[1]:
                return tensor
            return whole(tensor).transpose(1, 2)

        return super().load_weights((name, model_layout(name, tensor)) for name, tensor in weights)


class Qwen3_5ForConditionalGeneration(QwenVisionLanguage, Qwen3_5ForCausalLM):
    """Qwen3.5 / Qwen3.6 dense with its vision encoder (no DeepStack)."""

    default_mrope_section = (11, 11, 10)
    deepstack = False  # a deepstack_visual_indexes in its vision config is ignored, as by transformers


class Qwen3_5MoeForConditionalGeneration(QwenVisionLanguage, Qwen3_5MoeForCausalLM):
    """Qwen3.5 / Qwen3.6 MoE with its vision encoder (no DeepStack)."""

    default_mrope_section = (11, 11, 10)
    deepstack = False  # a deepstack_visual_indexes in its vision config is ignored, as by transformers

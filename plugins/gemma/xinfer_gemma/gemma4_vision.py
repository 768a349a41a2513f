"""Gemma 4 with images (``Gemma4ForConditionalGeneration``): the text model of
:mod:`xinfer_gemma.gemma4`, its vision encoder, and the embedder into the text model's space.

An image keeps its aspect ratio: it is resized (bicubic) to the largest size whose sides are
multiples of ``pooling_kernel_size * patch_size`` and that has at most ``max_soft_tokens *
pooling_kernel_size**2`` patches, read as ``[0, 1]`` pixels. The encoder:

- patches: a linear map of each patch's pixels (rows, columns, channels) scaled to ``[-1, 1]``,
  plus a learned embedding of its column and one of its row;
- layers: Gemma's sandwich-normed blocks (norms multiply by ``w``), attention of an image's
  patches to each other at scale 1 with q/k norms and weightless value norms, and 2D rotary: the
  first half of each head rotated by the patch's column, the second half by its row;
- pooling: the mean of each ``k x k`` group of patches, times ``sqrt(hidden)``, optionally
  standardised by the checkpoint's bias and scale;
- the embedder: a weightless RMSNorm and a projection to the text model's width.

In the prompt each image token (``<|image|>``) becomes ``<|image>``, one soft token per pooled
group, ``<image|>``, as transformers' processor writes it. Where the text config says
``use_bidirectional_attention="vision"`` an image's soft tokens attend to each other both ways in
the sliding-window layers (the global layers stay causal). Audio and video inputs are not served.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor, nn

from xinfer import ops
from xinfer.layers import Linear, RMSNorm, activation
from xinfer.layers.attention import check_head_groups
from xinfer.loading.stored import StoredTensor, Weights
from xinfer.multimodal import MultiModalItem
from xinfer.multimodal.image import Normalization, image_hash, preprocessor_config, resize, to_rgb
from xinfer_gemma.gemma4 import Gemma4ForCausalLM

DEFAULT_MAX_SOFT_TOKENS = 280  # transformers' image processor's default, where the checkpoint sets none
SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)  # the budgets transformers' image processor takes
UNIT_PIXELS = Normalization(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))  # [0, 1]: the encoder maps them to [-1, 1]
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


class ClippedLinear(nn.Module):
    """A linear map without bias; with ``clipped``, its input and output are clamped to bounds the
    checkpoint holds (``use_clipped_linears``)."""

    input_min: nn.Parameter
    input_max: nn.Parameter
    output_min: nn.Parameter
    output_max: nn.Parameter

    def __init__(self, in_features: int, out_features: int, clipped: bool):
        super().__init__()
        self.linear = Linear(in_features, out_features)
        self.clipped = clipped
        if clipped:
            bounds = ("input_min", "input_max", "output_min", "output_max")
            for name, value in zip(bounds, (-math.inf, math.inf, -math.inf, math.inf)):
                setattr(self, name, nn.Parameter(torch.tensor(value)))

    def forward(self, x: Tensor) -> Tensor:
        if not self.clipped:
            return self.linear(x)
        out = self.linear(x.clamp(self.input_min, self.input_max))
        return out.clamp(self.output_min, self.output_max)


class Gemma4VisionAttention(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        dim, clipped = config.hidden_size, config.use_clipped_linears
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        check_head_groups(self.num_heads, self.num_kv_heads, "vision_config.")
        self.head_dim, self.eps = config.head_dim, config.rms_norm_eps
        self.q = ClippedLinear(dim, self.num_heads * self.head_dim, clipped)
        self.k = ClippedLinear(dim, self.num_kv_heads * self.head_dim, clipped)
        self.v = ClippedLinear(dim, self.num_kv_heads * self.head_dim, clipped)
        self.o = ClippedLinear(self.num_heads * self.head_dim, dim, clipped)
        self.q_norm = RMSNorm(self.head_dim, self.eps)
        self.k_norm = RMSNorm(self.head_dim, self.eps)
        self.v_norm_weight: Tensor
        self.register_buffer("v_norm_weight", torch.ones(self.head_dim), persistent=False)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], cu_seqlens: Tensor) -> Tensor:
        q = self.q_norm(self.q(x).reshape(-1, self.head_dim)).view(-1, self.num_heads, self.head_dim)
        k = self.k_norm(self.k(x).reshape(-1, self.head_dim)).view(-1, self.num_kv_heads, self.head_dim)
        v = ops.rms_norm(self.v(x).reshape(-1, self.head_dim), self.v_norm_weight, self.eps)
        q, k = rotate_2d(q, k, *rope)
        out = ops.encoder_attention(q, k, v.view(-1, self.num_kv_heads, self.head_dim), cu_seqlens, 1.0)
        return self.o(out.flatten(1))


def rotate_2d(q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor) -> tuple[Tensor, Tensor]:
    """Each head's first half rotated by the column angles, its second half by the row angles:
    the halves stacked as rows ``[columns' T; rows' T]`` go through one ``ops.rotary``, whose
    table row ``i`` (``positions``) holds row ``i``'s angles."""
    stacked_q, stacked_k = (torch.cat(t.chunk(2, dim=-1), dim=0) for t in (q, k))
    stacked_q, stacked_k = ops.rotary(stacked_q, stacked_k, positions, cos_sin)
    return torch.cat(stacked_q.chunk(2, dim=0), dim=-1), torch.cat(stacked_k.chunk(2, dim=0), dim=-1)


class Gemma4VisionMLP(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        dim, inner, clipped = config.hidden_size, config.intermediate_size, config.use_clipped_linears
        self.gate = ClippedLinear(dim, inner, clipped)
        self.up = ClippedLinear(dim, inner, clipped)
        self.down = ClippedLinear(inner, dim, clipped)
        self.act = activation(config.hidden_activation, "hidden_activation")

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.act(self.gate(x)) * self.up(x))


class Gemma4VisionLayer(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma4VisionAttention(config)
        self.mlp = Gemma4VisionMLP(config)
        self.input_layernorm = RMSNorm(dim, eps)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps)
        self.post_feedforward_layernorm = RMSNorm(dim, eps)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], cu_seqlens: Tensor) -> Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, cu_seqlens))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma4PatchEmbedder(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        self.input_proj = Linear(3 * config.patch_size**2, config.hidden_size)
        self.position_embedding_table = nn.Parameter(torch.empty(2, config.position_embedding_size, config.hidden_size))

    def forward(self, patches: Tensor, columns: Tensor, rows: Tensor) -> Tensor:
        x = self.input_proj((2 * patches - 1).to(self.input_proj.weight.dtype))
        return x + self.position_embedding_table[0][columns] + self.position_embedding_table[1][rows]


class Gemma4VisionModel(nn.Module):
    """Patches of images [P, 3 * patch**2] (in ``[0, 1]``), image after image, with each image's
    patch grid (rows, columns) -> the pooled tokens of each image [N, hidden] in fp32."""

    def __init__(self, config: Any):
        super().__init__()
        if config.head_dim % 4:
            raise ValueError(
                f"vision_config.head_dim={config.head_dim} is not a multiple of 4: each half of a head rotates by "
                "the column or the row at head_dim / 4 frequencies"
            )
        if config.pooling_kernel_size < 2:
            raise ValueError(
                f"vision_config.pooling_kernel_size={config.pooling_kernel_size}: transformers' encoder keeps "
                "the padding patches where it does not pool"
            )
        self.pool = config.pooling_kernel_size
        self.patch_embedder = Gemma4PatchEmbedder(config)
        self.layers = nn.ModuleList(Gemma4VisionLayer(config) for _ in range(config.num_hidden_layers))
        quarter = config.head_dim // 4  # each half of a head rotates by head_dim / 4 frequencies
        theta = config.rope_parameters["rope_theta"]
        self.inv_freq: Tensor
        self.register_buffer("inv_freq", theta ** -(torch.arange(quarter, dtype=torch.float32) / quarter), False)
        self.standardize = config.standardize
        if config.standardize:
            self.std_bias = nn.Parameter(torch.zeros(config.hidden_size))
            self.std_scale = nn.Parameter(torch.ones(config.hidden_size))

    def forward(self, patches: Tensor, grids: Sequence[tuple[int, int]]) -> list[Tensor]:
        device = patches.device
        rows = torch.cat([torch.arange(h, device=device).repeat_interleave(w) for h, w in grids])
        columns = torch.cat([torch.arange(w, device=device).repeat(h) for h, w in grids])
        counts = torch.tensor([0] + [h * w for h, w in grids], device=device)
        cu_seqlens = counts.cumsum(0).to(torch.int32)
        angles = torch.cat([columns, rows]).float()[:, None] * self.inv_freq  # [2P, head_dim / 4]
        rope = torch.arange(len(angles), device=device), torch.cat([angles.cos(), angles.sin()], -1).to(patches.dtype)
        x = self.patch_embedder(patches, columns, rows)
        for layer in self.layers:
            x = layer(x, rope, cu_seqlens)
        return [self.pooled(image, grid) for image, grid in zip(x.split(counts[1:].tolist()), grids)]

    def pooled(self, patches: Tensor, grid: tuple[int, int]) -> Tensor:
        """The mean of each ``pool x pool`` group, row-major, times ``sqrt(hidden)`` (fp32)."""
        (h, w), dim = grid, patches.shape[-1]
        image = patches.float().T.reshape(1, dim, h, w)
        tokens = F.avg_pool2d(image, self.pool).flatten(2)[0].T * dim**0.5
        if self.standardize:
            tokens = (tokens - self.std_bias.float()) * self.std_scale.float()
        return tokens


class Gemma4VisionEmbedder(nn.Module):
    """Pooled vision tokens -> the text model's width: a weightless RMSNorm, then a projection."""

    def __init__(self, vision_size: int, text_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.embedding_projection = Linear(vision_size, text_size)
        self.norm_weight: Tensor
        self.register_buffer("norm_weight", torch.ones(vision_size), persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.embedding_projection(ops.rms_norm(tokens, self.norm_weight, self.eps))


def resized_size(height: int, width: int, patch: int, max_patches: int, pool: int) -> tuple[int, int]:
    """The largest (height, width) of the image's aspect ratio, both multiples of ``pool * patch``,
    with at most ``max_patches`` patches; a side that would round to nothing takes one multiple."""
    unit = pool * patch
    factor = math.sqrt(max_patches * patch**2 / (height * width))
    new_height, new_width = math.floor(factor * height / unit) * unit, math.floor(factor * width / unit) * unit
    longest = max_patches // pool**2 * unit
    if new_height == 0 and new_width == 0:
        raise ValueError(f"a {width}x{height} image cannot be resized to this model's patch grid")
    if new_height == 0:
        new_height, new_width = unit, min(width // height * unit, longest)
    elif new_width == 0:
        new_height, new_width = min(height // width * unit, longest), unit
    return new_height, new_width


def refuse_unencodable_settings(preprocessor: Mapping[str, Any], vision: Any) -> None:
    """One error where the checkpoint's image processor would cut patches the encoder does not take
    (transformers' then fails): another patch or pooling size than the vision config's, or images not resized;
    or a budget of soft tokens that transformers' processor does not take."""
    for field in ("patch_size", "pooling_kernel_size"):
        if preprocessor.get(field, getattr(vision, field)) != getattr(vision, field):
            raise ValueError(
                f"the image processor's {field} ({preprocessor[field]}) is not the vision config's "
                f"({getattr(vision, field)})"
            )
    if not preprocessor.get("do_resize", True):
        raise ValueError("the image processor's do_resize is false: images would not fit the encoder's patch grid")
    if (budget := preprocessor.get("max_soft_tokens", DEFAULT_MAX_SOFT_TOKENS)) not in SOFT_TOKEN_BUDGETS:
        raise ValueError(f"the image processor's max_soft_tokens ({budget}) is not one of {SOFT_TOKEN_BUDGETS}")


class Gemma4ImageProcessor:
    """Images -> patches: RGB, resized (bicubic) keeping the aspect ratio, ``/ 255``, cut into
    ``patch x patch`` squares flattened as (rows, columns, channels), row-major. The checkpoint's
    image processor settings may set another budget (``max_soft_tokens``), filter (``resample``)
    and scaling."""

    def __init__(self, config: Any, tokenizer: Any, preprocessor: Mapping[str, Any]):
        vision = config.vision_config
        self.patch, self.pool = vision.patch_size, vision.pooling_kernel_size
        refuse_unencodable_settings(preprocessor, vision)
        self.positions = vision.position_embedding_size
        self.max_patches = int(preprocessor.get("max_soft_tokens", DEFAULT_MAX_SOFT_TOKENS)) * self.pool**2
        self.resample = preprocessor.get("resample", "bicubic")
        self.convert_rgb = preprocessor.get("do_convert_rgb", True)
        self.normalization = Normalization.from_preprocessor(preprocessor, UNIT_PIXELS, normalize=False)
        self.placeholders = {"image": config.image_token_id}
        self.merges: dict[tuple[int, int], int] = {}
        self.boi, self.eoi, self.soft = config.boi_token_id, config.eoi_token_id, config.image_token_id

    def process(self, modality: str, data: Any) -> MultiModalItem:
        if not isinstance(data, Image.Image):
            raise ValueError(f"an image must be a PIL image, got {type(data).__name__}")
        height, width = resized_size(data.height, data.width, self.patch, self.max_patches, self.pool)
        p = self.patch
        if max(height, width) // p > self.positions:
            raise ValueError(
                f"a {data.width}x{data.height} image resizes to {width // p}x{height // p} patches, more per side "
                f"than this model's vision position_embedding_size ({self.positions})"
            )
        image = to_rgb(data, self.convert_rgb)
        if (height, width) != (image.height, image.width):
            image = resize(image, height, width, self.resample)
        pixels = self.normalization(image).permute(1, 2, 0)  # [H, W, C]
        patches = pixels.reshape(height // p, p, width // p, p, 3).transpose(1, 2).reshape(-1, p * p * 3)
        grid = (height // p, width // p)
        tokens = grid[0] * grid[1] // self.pool**2
        return MultiModalItem("image", image_hash(data), {"patches": patches}, tokens, extra={"grid": grid})

    def replacement(self, item: MultiModalItem) -> tuple[list[int], int]:
        return [self.boi, *[self.soft] * item.num_embeddings, self.eoi], 1


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """Gemma 4's text model with its vision encoder; tokens of one image attend to each other both
    ways where the config asks it (``attend_within_items``, in the sliding layers alone)."""

    def __init__(self, config: Any):
        wrapper = config.multimodal_config  # the loader hands the text config, the wrapper's beside it
        if wrapper.vision_config is None:
            raise ValueError("this Gemma4ForConditionalGeneration checkpoint has no vision encoder")
        self.attend_within_items = config.use_bidirectional_attention == "vision"
        super().__init__(config)
        self.wrapper_config = wrapper
        vision = wrapper.vision_config
        self.vision_tower = Gemma4VisionModel(vision)
        self.embed_vision = Gemma4VisionEmbedder(vision.hidden_size, config.hidden_size, vision.rms_norm_eps)
        # as transformers, every image, video and audio placeholder is embedded as the pad token, with or
        # without media (a generated one too)
        media = [wrapper.image_token_id, wrapper.video_token_id, getattr(wrapper, "audio_token_id", None)]
        self.model.media_token_ids = torch.tensor([i for i in media if i is not None])

    def multimodal_processor(self, tokenizer: Any) -> Gemma4ImageProcessor:
        return Gemma4ImageProcessor(self.wrapper_config, tokenizer, preprocessor_config(self.wrapper_config))

    def encode(self, modality: str, items: Sequence[MultiModalItem]) -> list[Tensor]:
        weight = self.embed_vision.embedding_projection.weight
        patches = torch.cat([item.data["patches"] for item in items]).to(weight.device, weight.dtype)
        tokens = self.vision_tower(patches, [item.extra["grid"] for item in items])
        return [self.embed_vision(t.to(weight.dtype)) for t in tokens]

    def load_weights(self, weights: Weights) -> set[str]:
        return super().load_weights(_vision_renamed(weights))


def _vision_renamed(weights: Weights) -> Iterator[tuple[str, Tensor | StoredTensor]]:
    """The vision tower's and embedder's tensors under this model's names (its projections are not
    merged: each may have its own clipping bounds); the rest as the text model reads them."""
    for name, tensor in weights:
        if name.startswith("model.vision_tower."):
            name = name.removeprefix("model.").replace(".encoder.layers.", ".layers.")
            for projection in PROJECTIONS:
                name = name.replace(f".{projection}_proj.", f".{projection}.")
        elif name.startswith("model.embed_vision."):
            name = name.removeprefix("model.")
        yield name, tensor

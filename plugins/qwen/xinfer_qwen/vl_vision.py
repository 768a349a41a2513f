"""The Qwen3-VL vision encoder (also Qwen3.5's, without DeepStack): a ViT over the patches of
each image, its output merged 2x2 into language-model tokens.

- patch embedding: a Conv3d whose stride is its kernel, i.e. one linear map of each flattened
  ``(channel, time, row, column)`` patch;
- absolute positions: a learned square table (its first ``side**2`` rows, ``side`` the integer
  square root of its size) resampled (bilinear, corners aligned) to each image's patch grid,
  added to the patch embeddings;
- relative positions: 2D rotary, the first half of each head's frequencies rotated by the
  patch's row, the second half by its column;
- blocks: pre-LayerNorm, attention of each image's patches to each other (no mask), an MLP;
- merger: the 4 patches of each 2x2 group concatenated and projected to the language model's
  width; DeepStack mergers do the same to the outputs of chosen blocks (LayerNorm after the
  concatenation there), and the language model adds those to its first layers' hidden states.

Patches arrive in merge-group order (:mod:`xinfer_qwen.vl_image`), so a group is 4
consecutive rows. The encoder's output is one tensor per batch: the merged tokens, then each
DeepStack level's, side by side ``[tokens, out_hidden * (1 + levels)]``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xinfer import ops
from xinfer.layers import LayerNorm, Linear, activation

Grid = tuple[int, int, int]  # (t, h, w) in patches
Rope = tuple[Tensor, Tensor]  # each patch's row of the table [N], the table (cos || sin) [N, head_dim]
ROTARY_TABLES = 64  # the grids whose rotary tables an encoder keeps


class PatchEmbedding(nn.Module):
    """The checkpoint's Conv3d (kernel = stride = one patch) as a linear map of flattened patches."""

    def __init__(self, config: Any):
        super().__init__()
        patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size**2
        self.proj = Linear(patch_dim, config.hidden_size, bias=True)

    def forward(self, patches: Tensor) -> Tensor:
        return self.proj(patches.to(self.proj.weight.dtype))

    def from_checkpoint(self, name: str, tensor: Tensor) -> Tensor:
        return tensor.flatten(1) if name == "proj.weight" else tensor


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = Linear(dim, 3 * dim, bias=True)
        self.proj = Linear(dim, dim, bias=True)

    def forward(self, x: Tensor, rope: Rope, cu_seqlens: Tensor) -> Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, self.head_dim)).unbind(1)
        q, k = ops.rotary(q, k, *rope)
        out = ops.encoder_attention(q, k, v, cu_seqlens, self.head_dim**-0.5)
        return self.proj(out.flatten(1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, hidden_act: str):
        super().__init__()
        self.linear_fc1 = Linear(dim, hidden, bias=True)
        self.linear_fc2 = Linear(hidden, dim, bias=True)
        self.act = activation(hidden_act)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        self.norm1 = LayerNorm(config.hidden_size)
        self.norm2 = LayerNorm(config.hidden_size)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.mlp = VisionMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, x: Tensor, residual: Tensor | None, rope: Rope, cu_seqlens: Tensor) -> tuple[Tensor, Tensor]:
        """The stream is ``x + residual`` (``x`` before the first block); returns this block's MLP
        output and the residual, which the next norm adds (one launch with the norm)."""
        h, residual = self.norm1(x, residual) if residual is not None else (self.norm1(x), x)
        h, residual = self.norm2(self.attn(h, rope, cu_seqlens), residual)
        return self.mlp(h), residual


class PatchMerger(nn.Module):
    """Each 2x2 group's 4 patch vectors concatenated, through a GELU MLP to the language model's
    width; normed per patch before the concatenation, or (DeepStack's) after it."""

    def __init__(self, config: Any, norm_after_concat: bool = False):
        super().__init__()
        self.group_dim = config.hidden_size * config.spatial_merge_size**2
        self.norm_after_concat = norm_after_concat
        self.norm = LayerNorm(self.group_dim if norm_after_concat else config.hidden_size)
        self.linear_fc1 = Linear(self.group_dim, self.group_dim, bias=True)
        self.linear_fc2 = Linear(self.group_dim, config.out_hidden_size, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        x = self.norm(x.view(-1, self.group_dim)) if self.norm_after_concat else self.norm(x).view(-1, self.group_dim)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionEncoder(nn.Module):
    """Qwen3-VL's ``model.visual``: patches [N, patch_dim] of images with patch grids ``grids``
    to their language-model embeddings [N / 4, out_hidden * (1 + len(deepstack_visual_indexes))]."""

    inv_freq: Tensor

    def __init__(self, config: Any, deepstack: bool = True):
        """``deepstack`` false: ``config.deepstack_visual_indexes`` ignored, as by the models without DeepStack."""
        super().__init__()
        check_supported(config)
        self.merge = config.spatial_merge_size
        self.patch_embed = PatchEmbedding(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.side = int(config.num_position_embeddings**0.5)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)
        indexes = getattr(config, "deepstack_visual_indexes", None) if deepstack else None
        self.deepstack_visual_indexes = list(indexes or [])
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(config, norm_after_concat=True) for _ in self.deepstack_visual_indexes
        )
        head_dim = config.hidden_size // config.num_heads
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        quarter = torch.arange(0, head_dim // 2, 2, dtype=torch.float32) / (head_dim // 2)
        self.register_buffer("inv_freq", 1.0 / theta**quarter, persistent=False)
        self.rotary_tables: dict[Grid, Tensor] = {}  # they depend on the grid alone

    @property
    def levels(self) -> int:
        """How many embeddings each merged token has: the merger's and one per block the DeepStack indexes name
        (an index past the last block, or named twice, adds none, as in transformers)."""
        return 1 + len(set(self.deepstack_visual_indexes) & set(range(len(self.blocks))))

    def forward(self, patches: Tensor, grids: Sequence[Grid]) -> Tensor:
        grids = [(int(t), int(h), int(w)) for t, h, w in grids]
        x = self.patch_embed(patches)
        x = x + per_patch(self.positions, grids).to(x.dtype)
        rope = torch.arange(len(x), device=x.device), per_patch(self.cached_rotary, grids)
        frames = [h * w for t, h, w in grids for _ in range(t)]  # each frame attends within itself
        cu_seqlens = torch.tensor([0, *itertools.accumulate(frames)], dtype=torch.int32, device=x.device)
        deepstack = []
        residual = None
        for index, block in enumerate(self.blocks):
            x, residual = block(x, residual, rope, cu_seqlens)
            if index in self.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[self.deepstack_visual_indexes.index(index)]
                deepstack.append(merger(x + residual))
        x = x if residual is None else x + residual
        return torch.cat([self.merger(x), *deepstack], dim=-1)

    def grouped(self, rows: Tensor, h: int, w: int) -> Tensor:
        """``rows`` [h, w, ...] of a patch grid in merge-group order [h * w, ...]."""
        m = self.merge
        return rows.unflatten(0, (h // m, m)).unflatten(2, (w // m, m)).transpose(1, 2).flatten(0, 3)

    def positions(self, grid: Grid) -> Tensor:
        """The learned position table resampled to the grid, per patch [t * h * w, hidden]."""
        t, h, w = grid
        square = self.pos_embed.weight[: self.side**2].float()
        table = square.T.unflatten(1, (self.side, self.side))[None]  # [1, hidden, side, side]
        resized = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0].permute(1, 2, 0)
        return self.grouped(resized, h, w).repeat(t, 1)

    def cached_rotary(self, grid: Grid) -> Tensor:
        """:meth:`rotary`, computed once per grid (a dozen small kernels each time otherwise)."""
        if grid not in self.rotary_tables:
            if len(self.rotary_tables) >= ROTARY_TABLES:
                self.rotary_tables.clear()
            self.rotary_tables[grid] = self.rotary(grid)
        return self.rotary_tables[grid]

    def rotary(self, grid: Grid) -> Tensor:
        """Each patch's rotary table row (cos || sin) [t * h * w, head_dim]: the frequencies
        times its row, then times its column."""
        t, h, w = grid
        rows = torch.arange(h, device=self.inv_freq.device)[:, None].expand(h, w)
        cols = torch.arange(w, device=self.inv_freq.device)[None, :].expand(h, w)
        row_col = self.grouped(torch.stack((rows, cols), dim=-1), h, w).float()  # [h * w, 2]
        angles = (row_col[:, :, None] * self.inv_freq).flatten(1)  # row's angles || column's
        return torch.cat((angles.cos(), angles.sin()), dim=-1).repeat(t, 1)


def check_supported(config: Any) -> None:
    """Refuse, in one line naming the field, a vision config transformers builds but cannot run an image through."""
    if config.hidden_size % config.num_heads:
        raise ValueError(
            f"vision_config hidden_size {config.hidden_size} is not a multiple of num_heads {config.num_heads}"
        )
    head_dim = config.hidden_size // config.num_heads
    if getattr(config, "head_dim", None) not in (None, head_dim):
        raise ValueError(f"vision_config head_dim {config.head_dim} is not hidden_size / num_heads ({head_dim}): "
                         "transformers' 2D rotary takes it, its attention does not")  # fmt: skip
    if head_dim % 4:
        raise ValueError(f"vision_config head dim {head_dim} (hidden_size / num_heads) is not a multiple of 4: "
                         "the 2D rotary gives rows and columns a half each, in pairs")  # fmt: skip
    if config.in_channels != 3:
        raise ValueError(f"vision_config in_channels {config.in_channels} is not supported: images are fed as RGB")


def per_patch(table: Callable[[Grid], Tensor], grids: Sequence[Grid]) -> Tensor:
    """The rows ``table(grid)`` of every image's patches, one after the other; computed once per
    distinct grid (the images of a batch often share one)."""
    tables = {grid: table(grid) for grid in dict.fromkeys(grids)}
    return tables[grids[0]] if len(grids) == 1 else torch.cat([tables[grid] for grid in grids])

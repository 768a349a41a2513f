"""SigLIP's vision transformer (the image encoder of Gemma 3): patches embedded by a strided
convolution (one GEMM over the unfolded patches), a learned position per patch, pre-norm
layers of non-causal attention and an MLP (``hidden_act``, gelu-tanh in Gemma 3), a final LayerNorm. Parameter names as
transformers' ``SiglipVisionTransformer``'s."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xinfer import ops
from xinfer.layers import LayerNorm, Linear, MergedLinear, activation


class SiglipAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"vision_config.hidden_size {dim} is not a multiple of num_attention_heads {num_heads}")
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv_proj = MergedLinear(dim, {"q": dim, "k": dim, "v": dim}, bias=True)
        self.out_proj = Linear(dim, dim, bias=True)

    def forward(self, x: Tensor, cu_seqlens: Tensor) -> Tensor:
        q, k, v = (t.reshape(-1, self.num_heads, self.head_dim) for t in self.qkv_proj.split(self.qkv_proj(x)))
        out = ops.encoder_attention(q, k, v, cu_seqlens, self.head_dim**-0.5)
        return self.out_proj(out.flatten(1))


class SiglipMLP(nn.Module):
    def __init__(self, dim: int, intermediate: int, hidden_act: str):
        super().__init__()
        self.fc1, self.fc2 = Linear(dim, intermediate, bias=True), Linear(intermediate, dim, bias=True)
        self.act = activation(hidden_act)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        dim, eps = config.hidden_size, config.layer_norm_eps
        self.layer_norm1, self.layer_norm2 = LayerNorm(dim, eps), LayerNorm(dim, eps)
        self.self_attn = SiglipAttention(dim, config.num_attention_heads)
        self.mlp = SiglipMLP(dim, config.intermediate_size, config.hidden_act)

    def forward(self, x: Tensor, residual: Tensor | None, cu_seqlens: Tensor) -> tuple[Tensor, Tensor]:
        """The stream is ``x + residual`` (``x`` before the first layer); returns this layer's MLP
        output and the residual, which the next norm adds (one launch with the norm)."""
        h, residual = self.layer_norm1(x, residual) if residual is not None else (self.layer_norm1(x), x)
        h, residual = self.layer_norm2(self.self_attn(h, cu_seqlens), residual)
        return self.mlp(h), residual


class SiglipEmbeddings(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        self.patch_size = config.patch_size
        if config.num_channels != 3:
            raise ValueError(f"vision_config.num_channels={config.num_channels}: images reach the encoder as RGB (3)")
        channels, dim = config.num_channels, config.hidden_size
        self.patch_embedding = PatchEmbedding(channels, dim, config.patch_size)
        self.position_embedding = nn.Embedding(((config.image_size // config.patch_size) ** 2), dim)

    def forward(self, pixel_values: Tensor) -> Tensor:
        """[B, C, H, W] -> the patches of each image, row by row, flat: [B * P, dim]."""
        patches = self.patch_embedding(pixel_values)  # [B, P, dim]
        return (patches + self.position_embedding.weight).flatten(0, 1)


class PatchEmbedding(nn.Module):
    """A ``kernel = stride = patch`` convolution, as one GEMM over the unfolded patches
    (the checkpoint's conv weight [dim, C, p, p] kept as is)."""

    def __init__(self, channels: int, dim: int, patch: int):
        super().__init__()
        self.patch = patch
        self.weight = nn.Parameter(torch.empty(dim, channels, patch, patch))
        self.bias = nn.Parameter(torch.empty(dim))

    def forward(self, pixel_values: Tensor) -> Tensor:
        patches = F.unfold(pixel_values, self.patch, stride=self.patch).transpose(1, 2)  # [B, P, C*p*p]
        return ops.linear(patches.flatten(0, 1), self.weight.flatten(1), self.bias).unflatten(0, patches.shape[:2])


class SiglipEncoder(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, x: Tensor, cu_seqlens: Tensor) -> tuple[Tensor, Tensor | None]:
        """The last layer's output and the residual stream before it (their sum is the hidden state)."""
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cu_seqlens)
        return x, residual


class SiglipVisionTransformer(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        self.embeddings = SiglipEmbeddings(config)
        self.encoder = SiglipEncoder(config)
        self.post_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, pixel_values: Tensor) -> Tensor:
        """Each image's last hidden states [B, P, dim] for ``pixel_values`` [B, C, H, W]."""
        num_images = pixel_values.shape[0]
        x = self.embeddings(pixel_values)
        per_image = x.shape[0] // num_images
        cu_seqlens = torch.arange(0, x.shape[0] + 1, per_image, dtype=torch.int32, device=x.device)
        x, residual = self.encoder(x, cu_seqlens)
        x = self.post_layernorm(x, residual)[0] if residual is not None else self.post_layernorm(x)
        return x.unflatten(0, (num_images, per_image))

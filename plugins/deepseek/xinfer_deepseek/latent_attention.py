"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash) in the absorbed form.

Each token caches one vector that every head shares: its normalised latent ``c`` (``kv_lora_rank`` R
values) and its rotated rope key ``k_rope`` (``qk_rope_head_dim`` P values). Head h's key would be
``[W_UK[h] c, k_rope]`` and its value ``W_UV[h] c`` (``kv_b_proj`` holds W_UK and W_UV); neither is
ever expanded::

    q_latent[h] = q_nope[h] @ W_UK[h]        # the key up-projection folded into the query
    s[h, j]     = scale * (q_latent[h] . c_j + q_rope[h] . k_rope_j)
    o_latent[h] = softmax(s[h]) @ c
    out[h]      = o_latent[h] @ W_UV[h]^T    # the value up-projection after attention

Prefill and decode both run this way, in two ops that a backend fuses within (the CUDA kernels at small
batches: :mod:`xinfer_deepseek.kernels.mla_rows` and :mod:`xinfer_deepseek.kernels.mla`): ``mla_rows``
makes the absorbed queries and the step's cache rows from the projections and stores the rows into a cache
of the model's dtype; ``mla_attention`` attends and up-projects the values (``mla_attention_fp8`` over fp8
rows, ``--kvcache-dtype fp8``, which encodes and stores the rows first; the row layout in
:mod:`xinfer_deepseek.mla_ops`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from xinfer import ops
from xinfer.cache.specs import TokenVectorSpec
from xinfer.distributed import current
from xinfer.distributed.group import WHOLE, Part
from xinfer.forward_context import attention_metadata
from xinfer.layers import (
    ColumnLinear,
    MergedLinear,
    RMSNorm,
    RotaryEmbedding,
    RowLinear,
    pairs_to_halves,
    rope_parameters,
)
from xinfer.layers.rotary import yarn_mscale
from xinfer.loading.stored import StoredTensor, part_of
from xinfer_deepseek.mla_ops import expand, fp8_row_bytes, fp8_row_fits

# the latents' norms (q_a_layernorm, kv_a_layernorm) keep the reference's own epsilon whatever the config's
# rms_norm_eps (GLM-4.7-Flash's 1e-5), as transformers' DeepSeek-V2/V3/V3.2 and GLM-4.7-Flash do, unless the
# config's latent_norm_eps says otherwise (a GGUF's: llama.cpp normalizes them with rms_norm_eps)
LATENT_NORM_EPS = 1e-6
# the checkpoint's projections of a layer's input, stored as the shards of LatentAttention.qkv_a_proj
PACKED_MODULES = {"q_a_proj": ("qkv_a_proj", "q"), "q_proj": ("qkv_a_proj", "q"),
                  "kv_a_proj_with_mqa": ("qkv_a_proj", "kv")}  # fmt: skip


class UpProjection(nn.Module):
    """``kv_b_proj`` [H * (N + V), R] held per head as its key half ``w_uk`` [H, N, R] and its value
    half ``w_uv`` [H, V, R], split at load. It loads the checkpoint's one matrix (``weight``) or the
    halves as llama.cpp's converter splits them (``k_b_proj.weight`` [H, R, N], transposed, and
    ``v_b_proj.weight``)."""

    def __init__(self, num_heads: int, kv_lora_rank: int, nope_dim: int, v_dim: int, heads: Part = WHOLE):
        super().__init__()
        self.heads = heads  # this rank's, under tensor parallelism
        self.w_uk = nn.Parameter(torch.empty(heads.size(num_heads), nope_dim, kv_lora_rank))
        self.w_uv = nn.Parameter(torch.empty(heads.size(num_heads), v_dim, kv_lora_rank))

    def expand(self, o_latent: Tensor) -> Tensor:
        """o_latent [T, H, R] -> the heads' outputs [T, H * V]."""
        return expand(o_latent, self.w_uv)

    def checkpoint_names(self) -> set[str]:
        return {"weight", *self.checkpoint_parts()}

    def checkpoint_parts(self) -> set[str]:
        return {"k_b_proj.weight", "v_b_proj.weight"}

    def load_checkpoint(self, name: str, stored: Tensor | StoredTensor) -> set[str]:
        _, nope_dim, rank = self.w_uk.shape
        head_rows = nope_dim + self.w_uv.shape[1]
        if name == "weight":  # this rank's heads: [H * (N + V), R] in rows of N + V per head
            tensor = part_of(stored, self.heads.slice(stored.shape[0] // head_rows, unit=head_rows))
            halves = tensor.view(-1, head_rows, rank).split([nope_dim, self.w_uv.shape[1]], dim=1)
            targets = {"k_b_proj.weight": (self.w_uk, halves[0]), "v_b_proj.weight": (self.w_uv, halves[1])}
        elif name == "k_b_proj.weight":
            targets = {name: (self.w_uk, part_of(stored, self.heads.slice(stored.shape[0])).transpose(1, 2))}
        elif name == "v_b_proj.weight":
            targets = {name: (self.w_uv, part_of(stored, self.heads.slice(stored.shape[0])))}
        else:
            raise ValueError(f"kv_b_proj: no parameter loads checkpoint tensor {name!r}")
        for part, (param, value) in targets.items():
            if param.shape != value.shape:
                raise ValueError(
                    f"weight kv_b_proj ({part}): checkpoint shape {tuple(value.shape)} != model shape "
                    f"{tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(value)
        return set(targets)


def softmax_scale(config: Any) -> float:
    """``1 / sqrt(qk_head_dim)``, times YaRN's ``mscale_all_dim`` temperature squared where the rope is scaled."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        scale *= yarn_mscale(params["factor"], params["mscale_all_dim"]) ** 2
    return scale


class LatentAttention(nn.Module):
    """The attention block of a DeepSeek-style layer (HF names): queries through ``q_a_proj``,
    ``q_a_layernorm`` and ``q_b_proj`` (q-LoRA) or one ``q_proj`` (``q_lora_rank`` null); the latent
    and rope key through ``kv_a_proj_with_mqa``, the latent normed by ``kv_a_layernorm``; ``kv_b_proj``
    split at load (:class:`UpProjection`); ``o_proj``. The two projections of the layer's input
    (``q_a_proj`` or ``q_proj``, and ``kv_a_proj_with_mqa``) are one GEMM, ``qkv_a_proj`` (shards
    ``q`` and ``kv``, :data:`PACKED_MODULES`): at batch 1 the latent's own GEMV (2.4 MB in
    Moonlight-16B-A3B) cost a launch more than its bytes.

    ``interleaved_rotary``: the checkpoint rotates adjacent pairs of the rope dims (``rope_interleave``);
    those rows of the query and rope-key projections are reordered at load into the halves
    ``ops.rotary`` rotates (q . k does not change when both are reordered alike).

    Under tensor parallelism each rank computes its part of the heads (``num_heads`` is then this
    rank's); the latent, which every head reads, is computed and cached whole on every rank.
    """

    def __init__(self, config: Any, rotary: RotaryEmbedding, interleaved_rotary: bool):
        super().__init__()
        self.q_lora_rank, self.kv_lora_rank = config.q_lora_rank, config.kv_lora_rank
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        hidden, heads, bias = config.hidden_size, config.num_attention_heads, config.attention_bias
        if config.num_key_value_heads != heads:
            # transformers expands the latent to a key and value per head, then repeats them again by
            # num_attention_heads // num_key_value_heads: a shape error
            raise ValueError(
                f"num_key_value_heads {config.num_key_value_heads} differs from num_attention_heads {heads}: "
                "latent attention has one key and value per head"
            )
        part = current().split(heads, "attention heads")
        self.num_heads = part.size(heads)
        q_size = heads * (self.nope_dim + self.rope_dim)
        latent_eps = getattr(config, "latent_norm_eps", LATENT_NORM_EPS)
        shards = {"q": self.q_lora_rank or q_size, "kv": self.kv_lora_rank + self.rope_dim}
        # (q_proj has no bias whatever attention_bias says, as in transformers; q_a_proj has)
        biased = ("q", "kv") if self.q_lora_rank else ("kv",)
        self.qkv_a_proj = MergedLinear(hidden, shards, biased if bias else False,
                                       parts={} if self.q_lora_rank else {"q": part})  # fmt: skip
        if self.q_lora_rank:
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, latent_eps)
            self.q_b_proj = ColumnLinear(self.q_lora_rank, q_size, part=part)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, latent_eps)
        self.kv_b_proj = UpProjection(heads, self.kv_lora_rank, self.nope_dim, config.v_head_dim, part)
        self.o_proj = RowLinear(heads * config.v_head_dim, hidden, bias, part)
        self.rotary_emb = rotary
        self.interleaved_rotary = interleaved_rotary
        self.scale = softmax_scale(config)
        self.cache: Tensor | None = None
        self.page_group = 0

    def cache_spec(self) -> TokenVectorSpec:
        """R + P values in the model's dtype; under the KV format fp8, their fp8 row (uint8), where R has one."""
        rank, rope = self.kv_lora_rank, self.rope_dim
        fp8 = {"fp8": TokenVectorSpec(fp8_row_bytes(rank, rope), dtype=torch.uint8)} if fp8_row_fits(rank) else {}
        return TokenVectorSpec(rank + rope, encoded=fp8)

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:
        return self.attend(positions, x, self.project(positions, self.qkv_a_proj(x)))

    def forward_norm(
        self, positions: Tensor, norm: RMSNorm, h: Tensor, residual: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """:meth:`forward` of ``norm(h + residual)``, the norm in ``qkv_a_proj`` (which also writes the
        normalized rows, for subclasses), and ``h + residual``."""
        projected, x, residual = norm.project(h, residual, self.qkv_a_proj.weight, self.qkv_a_proj.bias)
        return self.attend(positions, x, self.project(positions, projected)), residual

    def attend(self, positions: Tensor, x: Tensor, projected: tuple[Tensor, Tensor, Tensor, Tensor | None]) -> Tensor:
        """The output from :meth:`project`'s tensors (``x``, the normalized input, for subclasses)."""
        q_latent, q_rope, latent, _ = projected
        assert self.cache is not None, "the engine binds the latent cache before the first forward"
        op = "mla_attention_fp8" if self.cache.dtype == torch.uint8 else "mla_attention"  # (cache_spec)
        latent_to_store = None if self.rows_cache() is not None else latent
        meta, w_uv = attention_metadata(self.page_group), self.kv_b_proj.w_uv
        return self.o_proj(ops.call(op, q_latent, q_rope, latent_to_store, self.cache, meta, self.scale, w_uv))

    def rows_cache(self) -> Tensor | None:
        """The cache ``mla_rows`` stores the step's rows into: the latent cache where it holds them as
        they are (an fp8 one's rows are encoded and stored by the attention op)."""
        assert self.cache is not None, "the engine binds the latent cache before the first forward"
        return None if self.cache.dtype == torch.uint8 else self.cache

    def project(self, positions: Tensor, projected: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """The absorbed queries [T, H, R], their rotated rope parts [T, H, P], this step's latent rows
        [T, R + P] (normalised latent || rotated rope key; all three the op ``mla_rows``, which also stores
        the rows into :meth:`rows_cache`), and the q-LoRA latent (None without q-LoRA), from ``qkv_a_proj``'s
        output ``projected``. ``q_a_layernorm`` runs in ``q_b_proj``'s prologue."""
        q_first, kv = self.qkv_a_proj.split(projected)
        if self.q_lora_rank:
            q, q_resid, _ = self.q_a_layernorm.project(q_first, None, self.q_b_proj.weight, self.q_b_proj.bias)
        else:
            q, q_resid = q_first, None
        q = q.view(-1, self.num_heads, self.nope_dim + self.rope_dim)
        norm = self.kv_a_layernorm
        rotation, cache = self.rotary_emb.rotation(positions), self.rows_cache()
        slots = attention_metadata(self.page_group).slot_mapping if cache is not None else None
        q_latent, q_rope, rows = ops.call(
            "mla_rows", q, kv, rotation, norm.weight, norm.eps, self.kv_b_proj.w_uk, cache, slots
        )
        return q_latent, q_rope, rows, q_resid

    def from_checkpoint(self, name: str, tensor: Tensor) -> Tensor:
        if not self.interleaved_rotary:
            return tensor
        if name.startswith(("q_proj.", "q_b_proj.")):  # every head of the checkpoint's tensor
            return _rope_rows_to_halves(tensor, tensor.shape[0] // (self.nope_dim + self.rope_dim), self.rope_dim)
        if name.startswith("kv_a_proj_with_mqa."):
            return _rope_rows_to_halves(tensor, 1, self.rope_dim)
        return tensor


def _rope_rows_to_halves(rows: Tensor, num_heads: int, rope_dim: int) -> Tensor:
    """Each head's last ``rope_dim`` rows (its rope part) from adjacent pairs to halves."""
    heads = rows.unflatten(0, (num_heads, -1))
    rest, rope = heads.split([heads.shape[1] - rope_dim, rope_dim], dim=1)
    rope = pairs_to_halves(rope.flatten(0, 1), num_heads).unflatten(0, (num_heads, rope_dim))
    return torch.cat((rest, rope), dim=1).flatten(0, 1)

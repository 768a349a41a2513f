"""Gemma 4 (text): ``Gemma4ForCausalLM`` and the language model of ``Gemma4ForConditionalGeneration``.

Gemma 3's sandwich-normed decoder, and where it departs from it:

- sliding and global layers differ in head dim and KV heads (``config.per_layer_config``); global
  layers may take their values from the key projection (``attention_k_eq_v``, no ``v_proj``);
- values are RMS-normed too (no weight), and attention scores are not scaled (scale 1.0);
- global layers rotate by "proportional" rope: a quarter of the whole head's frequencies;
- norms multiply by ``w`` (not ``1 + w``), and each layer's output is multiplied by its ``layer_scalar``;
- E-models (``hidden_size_per_layer_input``): a second embedding table, with a projection of the
  embeddings, gives each layer an input that gates a residual branch after the MLP;
- the last ``num_kv_shared_layers`` layers cache nothing: they attend over the cache of the last
  earlier layer of their kind (:class:`SharedKVAttention`), and their MLPs may be twice as wide;
- MoE (26B-A4B): the dense MLP and the routed experts side by side, each with its own norms, the
  router on the residual stream with its own weightless norm and scale.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from xinfer import ops
from xinfer.distributed import current
from xinfer.forward_context import attention_metadata, multimodal
from xinfer.layers import (
    Attention,
    GatedMLP,
    Linear,
    LMHead,
    MergedLinear,
    RMSNorm,
    RotaryEmbedding,
    Router,
    Routing,
    RowLinear,
    VocabEmbedding,
    activation,
    head_norms,
    rope_parameters,
)
from xinfer.layers.moe import Experts
from xinfer.loading.stored import StoredTensor, Weights
from xinfer.model import HF_QKV_GATE_UP, CausalLM
from xinfer.ops import AttentionMetadata

log = logging.getLogger(__name__)

Norm = Callable[[int], RMSNorm]


class Gemma4Attention(nn.Module):
    """``o_proj(attention(rotary(q_norm(q)), rotary(k_norm(k)), v_norm(v)))`` at scale 1; with
    ``values_from_keys`` v is the key projection's output (before k's norm and rotary)."""

    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, rotary: RotaryEmbedding,
        norm: Norm, *, window: int | None, values_from_keys: bool, bias: bool, eps: float,
    ):  # fmt: skip
        super().__init__()
        tp = current()  # each rank its part of the heads (KV heads replicated below the rank count)
        heads, kv_heads = tp.split(num_heads, "attention heads"), tp.heads(num_kv_heads, "KV heads")
        self.num_heads, self.num_kv_heads = heads.size(num_heads), kv_heads.size(num_kv_heads)
        self.head_dim, self.eps = head_dim, eps
        kv_size = num_kv_heads * head_dim
        shards = {"q": num_heads * head_dim, "k": kv_size} | ({} if values_from_keys else {"v": kv_size})
        self.qkv_proj = MergedLinear(hidden_size, shards, bias, parts={"q": heads, "k": kv_heads, "v": kv_heads})
        self.o_proj = RowLinear(num_heads * head_dim, hidden_size, bias, heads)
        self.q_norm, self.k_norm = norm(head_dim), norm(head_dim)
        self.v_norm_weight: Tensor  # the value norm has no weight of its own
        self.register_buffer("v_norm_weight", torch.ones(head_dim), persistent=False)
        self.rotary_emb = rotary
        causal = CausalAttention if window is None else Attention
        self.attn = causal(self.num_heads, self.num_kv_heads, head_dim, scale=1.0, window=window)

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:
        q, k, *v = self.qkv_proj.split(self.qkv_proj(x))
        values = (v[0] if v else k).reshape(-1, self.head_dim)
        values = ops.rms_norm(values, self.v_norm_weight, self.eps)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k, head_norms(self.q_norm, self.k_norm))
        return self.o_proj(self.attn(q, k, values))


class CausalAttention(Attention):
    """Attention that stays causal where the step lets image tokens see their image's later ones
    (``key_limits``): Gemma 4's global layers, unlike its sliding ones."""

    def step_metadata(self) -> AttentionMetadata:
        return causal(super().step_metadata())


def causal(meta: AttentionMetadata) -> AttentionMetadata:
    return meta if meta.key_limits is None else dataclasses.replace(meta, key_limits=None)


class SharedKVAttention(nn.Module):
    """A layer of the KV-shared tail: its own queries, attending over the cache of ``source`` (the
    last earlier layer of its kind, which wrote this step's keys and values before this layer runs).
    It caches nothing: it is not a caching layer, and ``source`` is not one of its modules."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, rotary: RotaryEmbedding, norm: Norm,
                 source: Attention, bias: bool):  # fmt: skip
        super().__init__()
        heads = current().split(num_heads, "attention heads")  # the same heads as its source's rank reads
        self.num_heads, self.head_dim = heads.size(num_heads), head_dim
        self.qkv_proj = MergedLinear(hidden_size, {"q": num_heads * head_dim}, bias, parts={"q": heads})
        self.o_proj = RowLinear(num_heads * head_dim, hidden_size, bias, heads)
        self.q_norm = norm(head_dim)
        self.rotary_emb = rotary
        self.source = (source,)  # a tuple, so that nn.Module does not adopt it

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:
        q = self.qkv_proj(x).view(-1, self.num_heads, self.head_dim)
        # ops.rotary rotates a (q, k) pair: one of q's heads stands in for the keys this layer lacks
        q, _ = self.rotary_emb(positions, q, q[:, :1], head_norms(self.q_norm, self.q_norm))
        return self.o_proj(read_cache(self.source[0], q).flatten(1))


def read_cache(attn: Attention, q: Tensor) -> Tensor:
    """``attn``'s attention of queries ``q`` [T, H, D] over what its cache holds, storing nothing
    (every slot -1, as padding is skipped)."""
    meta = attention_metadata(attn.page_group)
    shadows = meta.shadows
    if shadows is not None:
        shadows = dataclasses.replace(shadows, slot_mapping=torch.full_like(shadows.slot_mapping, -1))
    unwritten = dataclasses.replace(meta, slot_mapping=torch.full_like(meta.slot_mapping, -1), shadows=shadows)
    if attn.window is None:
        unwritten = causal(unwritten)
    kv = q.new_zeros(q.shape[0], attn.num_kv_heads, attn.head_dim)
    assert attn.cache is not None, "the engine binds the KV cache before the first forward"
    return ops.attention(q, kv, kv, attn.cache, unwritten, attn.scale, attn.window)


class Gemma4Router(Router):
    """Core's router (softmax, top-k renormalized, times a per-expert scale) on the residual stream
    normed without weight, times ``scale`` and ``hidden**-0.5`` (folded into ``scale`` at load)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, eps: float):
        super().__init__(hidden_size, num_experts, None, Routing(top_k=top_k, renormalize=True, per_expert_scale=True))
        self.scale = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: Tensor, token_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return super().forward(ops.rms_norm(x, self.scale, self.eps))

    def from_checkpoint(self, name: str, tensor: Tensor) -> Tensor:
        return tensor * tensor.shape[0] ** -0.5 if name == "scale" else tensor


class Gemma4DecoderLayer(nn.Module):
    """``x += norm(attn(norm(x)))``; ``x += norm(mlp(norm(x)))`` (with experts: the normed sum of the
    MLP's and the experts' outputs, each normed); E-models: ``x += norm(proj(act(gate(x)) * input))``
    with this layer's per-layer input; finally ``x *= layer_scalar``."""

    def __init__(self, config: Any, self_attn: nn.Module, intermediate_size: int, norm: Norm):
        super().__init__()
        hidden, per_layer = config.hidden_size, config.hidden_size_per_layer_input
        self.self_attn = self_attn
        self.mlp = GatedMLP(hidden, intermediate_size, config.hidden_activation)
        self.input_layernorm = norm(hidden)
        self.post_attention_layernorm = norm(hidden)
        self.pre_feedforward_layernorm = norm(hidden)
        self.post_feedforward_layernorm = norm(hidden)
        self.layer_scalar = nn.Parameter(torch.ones(1))
        self.experts: Experts | None = None
        if config.enable_moe_block:
            unset = [
                name for name in ("num_experts", "top_k_experts", "moe_intermediate_size") if not getattr(config, name)
            ]
            if unset:  # transformers' experts fail to build
                raise ValueError(f"enable_moe_block True needs {', '.join(unset)} (unset)")
            self.router = Gemma4Router(hidden, config.num_experts, config.top_k_experts, config.rms_norm_eps)
            self.experts = Experts(
                config.num_experts, hidden, config.moe_intermediate_size, config.hidden_activation,
                activation_field="hidden_activation",
            )  # fmt: skip
            self.pre_feedforward_layernorm_2 = norm(hidden)
            self.post_feedforward_layernorm_1 = norm(hidden)
            self.post_feedforward_layernorm_2 = norm(hidden)
        if per_layer:
            self.per_layer_input_gate = Linear(hidden, per_layer)
            self.per_layer_projection = Linear(per_layer, hidden)
            self.post_per_layer_input_norm = norm(hidden)
            self.per_layer_act = activation(config.hidden_activation, "hidden_activation")

    def forward(self, positions: Tensor, x: Tensor, per_layer_input: Tensor | None) -> Tensor:
        h = self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x)))
        h, x = self.pre_feedforward_layernorm(h, x)
        out = self.mlp(h)
        if self.experts is not None:
            weights, ids = self.router(x)
            routed = self.experts(self.pre_feedforward_layernorm_2(x), weights, ids)
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(routed)
        x = x + self.post_feedforward_layernorm(out)
        if per_layer_input is not None:
            gated = self.per_layer_act(self.per_layer_input_gate(x)) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar


def _rounded(scale: float) -> Tensor:
    # in the model dtype, as the reference scales its embeddings (sqrt(3072) is 55.5 in bf16)
    return torch.tensor(scale, dtype=torch.float32).to(torch.get_default_dtype())


class Gemma4Model(nn.Module):
    """Scaled embeddings through the layers, then the final norm; E-models also give each layer its
    per-layer input: ``(norm(proj(embeddings) / sqrt(hidden)) + per_layer_embeddings) / sqrt(2)``."""

    def __init__(self, config: Any, layers: Iterable[nn.Module], norm: Norm):
        super().__init__()
        hidden, self.per_layer = config.hidden_size, config.hidden_size_per_layer_input
        self.pad_token_id = config.pad_token_id or 0
        # an image-text checkpoint's media placeholder ids, which it embeds as the pad token (its images' rows
        # then take their encoder's embeddings); None: a text model's, which has none
        self.media_token_ids: Tensor | None
        self.register_buffer("media_token_ids", None, persistent=False)
        self.embed_tokens = VocabEmbedding(config.vocab_size, hidden)
        self.layers = nn.ModuleList(layers)
        self.norm = norm(hidden)
        self.register_buffer("embed_scale", _rounded(hidden**0.5), persistent=False)
        if self.per_layer:
            if config.vocab_size_per_layer_input < config.vocab_size:
                raise ValueError(
                    f"vocab_size_per_layer_input {config.vocab_size_per_layer_input} is smaller than vocab_size "
                    f"{config.vocab_size}: the tokens past it have no per-layer embedding"
                )
            width = config.num_hidden_layers * self.per_layer
            self.embed_tokens_per_layer = VocabEmbedding(config.vocab_size_per_layer_input, width)
            self.register_buffer("per_layer_embed_scale", _rounded(self.per_layer**0.5), persistent=False)
            self.per_layer_model_projection = Linear(hidden, width)
            self.per_layer_projection_norm = norm(self.per_layer)

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        if self.media_token_ids is not None:  # the pad's embeddings and per-layer inputs, generated ones too
            input_ids = torch.where(torch.isin(input_ids, self.media_token_ids), self.pad_token_id, input_ids)
        x = self.embed_tokens(input_ids) * self.embed_scale
        if (images := multimodal()) is not None:  # image tokens take their encoder's embeddings
            x = images.merge(x)
        per_layer_inputs = self.per_layer_inputs(input_ids, x) if self.per_layer else [None] * len(self.layers)
        for layer, per_layer_input in zip(self.layers, per_layer_inputs):
            x = layer(positions, x, per_layer_input)
        return self.norm(x)

    def per_layer_inputs(self, input_ids: Tensor, embeddings: Tensor) -> tuple[Tensor, ...]:
        """Each layer's input [T, per_layer]."""
        tokens = self.embed_tokens_per_layer(input_ids) * self.per_layer_embed_scale
        context = self.per_layer_model_projection(embeddings) * embeddings.shape[-1] ** -0.5
        context = self.per_layer_projection_norm(context.reshape(-1, self.per_layer)).view_as(tokens)
        return ((context + tokens) * 2**-0.5).unflatten(-1, (len(self.layers), self.per_layer)).unbind(1)


class Gemma4ForCausalLM(CausalLM):
    packed_modules = HF_QKV_GATE_UP

    def __init__(self, config: Any):
        super().__init__(config)
        if getattr(config, "use_bidirectional_attention", None) == "all":
            raise NotImplementedError("Gemma 4 with use_bidirectional_attention='all' is not a causal LM xinfer serves")
        norm = functools.partial(RMSNorm, eps=config.rms_norm_eps)
        kinds = config.layer_types
        rotary = {
            kind: RotaryEmbedding(
                config.per_layer_config[kind].head_dim, config.max_position_embeddings, rope(config, kind)
            )
            for kind in dict.fromkeys(kinds)  # (in layer order: the first missing rope is the one named)
        }
        sources: dict[str, Attention] = {}
        layers = []
        for index, (kind, reuses) in enumerate(zip(kinds, reuses_kv(config))):
            layer = config.per_layer_config[index]
            bias, heads = config.attention_bias, config.num_attention_heads
            if reuses and kind not in sources:
                raise ValueError(
                    f"layer {index} reads the KV cache of an earlier {kind} layer, and there is none "
                    f"(num_kv_shared_layers {config.num_kv_shared_layers} of layer_types {kinds})"
                )
            if reuses:
                attn: nn.Module = SharedKVAttention(
                    config.hidden_size, heads, layer.head_dim, rotary[kind], norm, sources[kind], bias
                )
            else:
                sliding = kind == "sliding_attention"
                attn = Gemma4Attention(
                    config.hidden_size, heads, layer.num_key_value_heads, layer.head_dim, rotary[kind], norm,
                    window=config.sliding_window if sliding else None,
                    values_from_keys=config.attention_k_eq_v and not sliding, bias=bias, eps=config.rms_norm_eps,
                )  # fmt: skip
                sources[kind] = attn.attn
            wide = config.use_double_wide_mlp and reuses
            layers.append(Gemma4DecoderLayer(config, attn, config.intermediate_size * (2 if wide else 1), norm))
        self.model = Gemma4Model(config, layers, norm)
        self.lm_head = LMHead.of(config, self.model.embed_tokens, config.final_logit_softcapping)

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Weights) -> set[str]:
        return super().load_weights(self._renamed(text_part(weights)))

    def _renamed(self, weights: Weights) -> Iterator[tuple[str, Tensor | StoredTensor]]:
        """The router's projection under core's name, and no keys or values for the KV-shared layers
        (checkpoints may still hold them)."""
        shared = {f"model.layers.{i}.self_attn." for i, reuses in enumerate(reuses_kv(self.config)) if reuses}
        for name, tensor in weights:
            *module, projection, _ = name.split(".")
            if projection in ("k_proj", "v_proj", "k_norm", "v_norm") and ".".join(module) + "." in shared:
                continue
            yield name.replace(".router.proj.", ".router."), tensor


def reuses_kv(config: Any) -> list[bool]:
    """Whether each layer reads an earlier layer's cache instead of keeping its own: the last
    ``num_kv_shared_layers`` do. Computed here because the config's ``kv_sharing_modes`` exists only in
    newer transformers releases."""
    first_shared = config.num_hidden_layers - (getattr(config, "num_kv_shared_layers", 0) or 0)
    return [index >= first_shared for index in range(config.num_hidden_layers)]


def rope(config: Any, layer_type: str) -> dict[str, Any]:
    """``layer_type``'s rope parameters; its "default" rope turns the whole head whatever ``partial_rotary_factor``
    says, as transformers' Gemma 4 computes it ("proportional" turns a part of it by its own table)."""
    if layer_type not in (getattr(config, "rope_parameters", None) or {}):
        # transformers looks each layer type's rope up by its name: a KeyError
        raise ValueError(f"rope_parameters has no {layer_type!r} entry: Gemma 4 takes one rope dict per layer type")
    params = rope_parameters(config, layer_type)
    factor, kind = params["partial_rotary_factor"], params["rope_type"]
    if factor != 1 and kind not in ("default", "proportional"):
        # transformers sizes the other tables by the factor, then rotates whole heads with them: a shape error
        raise ValueError(f"partial_rotary_factor {factor} with rope_type {kind!r} ({layer_type}) is not supported: "
                         f"Gemma 4 rotates whole heads but by the proportional rope")  # fmt: skip
    return {**params, "partial_rotary_factor": 1.0} if kind == "default" else params


_AUDIO = ("model.audio_tower.", "model.embed_audio.")


def text_part(weights: Weights) -> Iterator[tuple[str, Tensor | StoredTensor]]:
    """The language model's tensors under the names of a text-only checkpoint (and the vision
    tower's, which a text-only model ignores); the audio tower's are left out, with one log line."""
    logged = False
    for name, tensor in weights:
        if name.startswith(_AUDIO):
            if not logged:
                log.info("skipping the checkpoint's audio tower: xinfer takes no audio")
                logged = True
            continue
        yield name.replace("model.language_model.", "model.", 1), tensor

"""A decoder-only LM composed of the core blocks; an architecture is a ``DecoderSpec`` plus
whatever is truly its own."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor, nn

from xinfer.layers.decoder import DecoderModel
from xinfer.layers.decoder_layer import DecoderLayer, SandwichDecoderLayer
from xinfer.layers.embedding import LMHead
from xinfer.layers.mlp import GatedMLP
from xinfer.layers.norm import RMSNorm
from xinfer.layers.rotary import RotaryEmbedding, context_limit, rope_parameters
from xinfer.layers.self_attention import SelfAttention
from xinfer.model import HF_QKV_GATE_UP, CausalLM

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecoderSpec:
    """How an architecture departs from Llama. Sizes come from the config (``head_dim``, ``layer_types``,
    ``sliding_window``, the rope parameters per layer type, ``tie_word_embeddings``), and the options below
    from the config fields they name, where the architecture's transformers code reads them: a field it does
    not read (a bias or a softcap a config carries anyway) changes nothing, as there."""

    # biases: True or False as the architecture fixes them, or the config field that says (Llama's: all of them)
    qkv_bias: bool | str = "attention_bias"
    o_bias: bool | str = "attention_bias"
    mlp_bias: bool | str = "mlp_bias"
    activation: str = "hidden_act"  # the config field naming the MLP's activation (Gemma: hidden_activation)
    query_pre_attn_scalar: bool = False  # scores scaled by the config's query_pre_attn_scalar**-0.5 (Gemma)
    final_logit_softcapping: bool = False  # logits capped by the config's final_logit_softcapping (Gemma)
    qk_norm: bool = False  # RMSNorm over each q and k head before rotary
    sandwich_norms: bool = False  # norms on the attention's and the MLP's outputs too
    norm_weight_offset: float = 0.0  # norms multiply by offset + w (Gemma: 1)
    scale_embeddings: bool = False  # embeddings times sqrt(hidden)
    interleaved_rotary: bool = False  # rotary over adjacent pairs (GPT-J style) rather than halves
    output_gate: bool = False  # attention output times sigmoid(a gate from q's projection) (Qwen3-Next)
    # rotary over each head's first partial_rotary_factor (Phi-3, GLM); else over the whole head, as transformers'
    # Llama-style rotary does with the default rope whatever the factor (a scaled rope with a factor is refused)
    partial_rotary: bool = False
    # a sequence that outgrows LongRoPE's trained context is recomputed with the long factors, as transformers'
    # Phi-3 generate does (CausalLM.context_switch); else the keys cached before stay as they were
    longrope_recompute: bool = False
    # the config's sliding_window windows the attention (Mistral, Phi-3, Qwen, Gemma); where transformers' attention
    # has none, a window the config sets anyway is not read either (see log_unread_window)
    sliding_window: bool = True


class DecoderForCausalLM(CausalLM):
    """Embeddings, decoder layers of ``SelfAttention`` and ``GatedMLP``, final norm, LM head.

    An architecture whose attention or MLP is its own (MoE, MLA, ...) overrides
    ``attention`` or ``mlp``; the layers take any module.
    """

    spec: ClassVar[DecoderSpec] = DecoderSpec()
    packed_modules = HF_QKV_GATE_UP

    def __init__(self, config: Any):
        super().__init__(config)
        if not self.spec.sliding_window:
            log_unread_window(config, type(self).__name__)
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        layer_types = getattr(config, "layer_types", None) or [None] * config.num_hidden_layers
        rotary = {
            kind: RotaryEmbedding(self.head_dim, context_limit(config), self.rope_parameters(config, kind))
            for kind in dict.fromkeys(layer_types)  # (in layer order: a refusal names the first layer type)
        }
        self.model = DecoderModel(
            config.vocab_size,
            config.hidden_size,
            (self.layer(config, i, rotary[kind]) for i, kind in enumerate(layer_types)),
            self.rms_norm(config.hidden_size),
            embed_scale=config.hidden_size**0.5 if self.spec.scale_embeddings else None,
        )
        softcap = getattr(config, "final_logit_softcapping", None) if self.spec.final_logit_softcapping else None
        self.lm_head = LMHead.of(config, self.model.embed_tokens, softcap)
        switches = [table.trained_context for table in rotary.values() if table.trained_context is not None]
        self.context_switch = min(switches, default=None)
        self.recompute_past_switch = self.spec.longrope_recompute

    def rope_parameters(self, config: Any, layer_type: str | None) -> dict[str, Any]:
        params = rope_parameters(config, layer_type)
        if self.spec.partial_rotary:
            return params
        factor, kind = params["partial_rotary_factor"], params["rope_type"]
        if factor != 1 and kind != "default":
            # transformers' whole-head rotary ignores the factor in its default table but sizes a scaled one by it,
            # which then fits no head: it fails, so no output is the reference's
            raise ValueError(f"partial_rotary_factor {factor} with rope_type {kind!r} is not supported: "
                             f"{type(self).__name__} rotates whole heads")  # fmt: skip
        return {**params, "partial_rotary_factor": 1.0}

    def layer(self, config: Any, index: int, rotary: RotaryEmbedding) -> nn.Module:
        layer = SandwichDecoderLayer if self.spec.sandwich_norms else DecoderLayer
        norm = functools.partial(self.rms_norm, config.hidden_size)
        return layer(self.attention(config, index, rotary), self.mlp(config, index), norm)

    def attention(self, config: Any, index: int, rotary: RotaryEmbedding) -> nn.Module:
        scalar = (self.spec.query_pre_attn_scalar and getattr(config, "query_pre_attn_scalar", None)) or self.head_dim
        return SelfAttention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            self.head_dim,
            rotary,
            qkv_bias=setting(config, self.spec.qkv_bias),
            o_bias=setting(config, self.spec.o_bias),
            qk_norm=self.rms_norm if self.spec.qk_norm else None,
            scale=scalar**-0.5,
            window=sliding_window(config, index) if self.spec.sliding_window else None,
            interleaved_rotary=self.spec.interleaved_rotary,
            output_gate=self.spec.output_gate,
        )

    def mlp(self, config: Any, index: int) -> nn.Module:
        activation = getattr(config, self.spec.activation)
        return GatedMLP(config.hidden_size, config.intermediate_size, activation, self.mlp_bias(config))

    def mlp_bias(self, config: Any) -> bool:
        return setting(config, self.spec.mlp_bias)

    def rms_norm(self, dim: int) -> RMSNorm:
        return RMSNorm(dim, self.config.rms_norm_eps, self.spec.norm_weight_offset)

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden)


def setting(config: Any, value: bool | str) -> bool:
    """A spec's switch: ``value`` itself, or the config field it names (absent or null: off)."""
    return bool(getattr(config, value, None)) if isinstance(value, str) else value


def sliding_window(config: Any, index: int) -> int | None:
    """Layer ``index``'s window: per ``layer_types`` where the config has them, else the
    config-wide ``sliding_window``."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        if layer_types[index] != "sliding_attention":
            return None
        if window is None:  # transformers' sliding mask takes a size: it fails
            raise ValueError(f"layer_types[{index}] is 'sliding_attention' but sliding_window is None")
    if window is not None and window < 2:
        # transformers fails on a window of 0 and, caching the last window - 1 keys, keeps every key at 1
        raise ValueError(f"sliding_window {window} is not supported: a window holds at least 2 tokens")
    return window


def log_unread_window(config: Any, architecture: str) -> None:
    """Says once at load that ``architecture`` attends to every earlier token whatever ``sliding_window`` says, as
    its transformers attention does. (transformers' ``generate`` alone reads the field: the cache it builds from a
    config without ``layer_types`` keeps only the last window - 1 keys, so it departs from its own forward once a
    sequence outgrows the window.)"""
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "layer_types", None) is None and window < config.max_position_embeddings:
        log.warning("sliding_window %d is not read: %s attends to every earlier token", window, architecture)

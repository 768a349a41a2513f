"""Llama and the models built like it: the core decoder as the config describes it
(biases, rope scaling, sliding window, tied embeddings)."""

from xinfer.layers import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """Pre-norm attention then a gated MLP: ``h += attn(norm(h)); h += mlp(norm(h))``."""


class MistralForCausalLM(DecoderForCausalLM):
    """Llama with a sliding window on every layer (``config.sliding_window``)."""

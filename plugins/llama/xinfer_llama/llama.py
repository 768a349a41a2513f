"""Llama and the models built like it: the core decoder as the config describes it
(biases, rope scaling, tied embeddings; Mistral's sliding window)."""

from xinfer.layers import DecoderForCausalLM, DecoderSpec


class LlamaForCausalLM(DecoderForCausalLM):
    """Pre-norm attention then a gated MLP: ``h += attn(norm(h)); h += mlp(norm(h))``; no window, as in
    transformers' Llama (a ``sliding_window`` the config sets anyway is not read)."""

    spec = DecoderSpec(sliding_window=False)


class MistralForCausalLM(DecoderForCausalLM):
    """Llama with a sliding window on every layer (``config.sliding_window``), and no biases."""

    spec = DecoderSpec(qkv_bias=False, o_bias=False, mlp_bias=False)

from xinfer.layers import DecoderForCausalLM, DecoderSpec


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Llama with biases on the q, k and v projections (not on o)."""

    spec = DecoderSpec(qkv_bias=True)


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Llama with an RMSNorm over each head of q and k before rope."""

    spec = DecoderSpec(qk_norm=True)

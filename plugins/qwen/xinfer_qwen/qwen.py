from xinfer.layers import DecoderForCausalLM, DecoderSpec


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Llama with biases on the q, k and v projections (none on o or the MLP)."""

    spec = DecoderSpec(qkv_bias=True, o_bias=False, mlp_bias=False)


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Llama with an RMSNorm over each head of q and k before rope (no MLP biases)."""

    spec = DecoderSpec(qk_norm=True, mlp_bias=False)

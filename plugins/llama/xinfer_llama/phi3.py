from xinfer.layers import DecoderForCausalLM, DecoderSpec


class Phi3ForCausalLM(DecoderForCausalLM):
    """Llama whose checkpoint already stores ``qkv_proj`` and ``gate_up_proj`` fused,
    exactly as the merged layers hold them; rope may be partial
    (``partial_rotary_factor``)."""

    spec = DecoderSpec(partial_rotary=True)
    packed_modules = {}

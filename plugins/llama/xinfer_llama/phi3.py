from xinfer.layers import DecoderForCausalLM, DecoderSpec


class Phi3ForCausalLM(DecoderForCausalLM):
    """Llama whose checkpoint already stores ``qkv_proj`` and ``gate_up_proj`` fused,
    exactly as the merged layers hold them; rope may be partial
    (``partial_rotary_factor``); a sequence that outgrows LongRoPE's trained context is
    recomputed with the long factors, as transformers' Phi-3 ``generate`` does. No biases."""

    spec = DecoderSpec(qkv_bias=False, o_bias=False, mlp_bias=False, partial_rotary=True, longrope_recompute=True)
    packed_modules = {}

from xinfer_llama.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Llama whose checkpoint already stores ``qkv_proj`` and ``gate_up_proj`` fused,
    exactly as the merged layers hold them; rope may be partial
    (``partial_rotary_factor``)."""

    packed_modules = {}

"""GLM-4 as first released (``GlmForCausalLM``, GLM-4-9B-hf): Llama with rotary over adjacent pairs of
each head's first ``partial_rotary_factor`` (a half)."""

from xinfer.layers import DecoderForCausalLM, DecoderSpec
from xinfer.model import HF_QKV_GATE_UP


class GlmForCausalLM(DecoderForCausalLM):
    """Biases on q, k and v where the config sets ``attention_bias``, never on o; the checkpoint
    stores ``gate_up_proj`` fused, as the merged layer holds it."""

    spec = DecoderSpec(o_bias=False, mlp_bias=False, interleaved_rotary=True, partial_rotary=True, sliding_window=False)
    packed_modules = {part: HF_QKV_GATE_UP[part] for part in ("q_proj", "k_proj", "v_proj")}

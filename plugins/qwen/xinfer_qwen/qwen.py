from xinfer_llama.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with biases on the q, k and v projections."""

    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama with an RMSNorm over each head of q and k before rope."""

    qk_norm = True

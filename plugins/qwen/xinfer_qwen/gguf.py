"""GGUF files of architectures ``qwen2`` and ``qwen3``.

llama.cpp runs these with NeoX-style rotary, so its converter stores q/k unpermuted
(unlike ``llama``): the tensors are the HF ones, and only the model_type needs naming.
"""

from xinfer.loading.gguf import GGUFAdapter

QWEN2 = GGUFAdapter(model_type="qwen2")
QWEN3 = GGUFAdapter(model_type="qwen3")

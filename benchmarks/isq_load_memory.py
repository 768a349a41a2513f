"""Peak device memory while a model loads with and without ``--isq``: the Qwen2.5-14B shape (or fewer of its
layers) with dummy weights, built and loaded as the engine does (``load_model``), then
``torch.cuda.max_memory_allocated`` and what the model holds. With ``--isq`` each weight is packed as soon as it is
loaded, so the peak is the packed model plus about one layer in float, not the float model.

    python benchmarks/isq_load_memory.py [--layers 48] [--isq q4_k]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from xinfer.loading.loader import load_config, load_model

QWEN25_14B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 5120,
    "intermediate_size": 13824, "num_attention_heads": 40, "num_key_value_heads": 8, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=48, help="of the shape's 48")
    parser.add_argument("--isq", default=None, help="a --isq format (default: none, the bf16 model)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps({**QWEN25_14B, "num_hidden_layers": args.layers}))
        device = torch.device("cuda")
        model = load_model(Path(folder), load_config(Path(folder)), device, torch.bfloat16, "dummy", args.isq)
        print(json.dumps({"layers": args.layers, "isq": args.isq,
                          "peak_GiB": round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
                          "held_GiB": round(torch.cuda.memory_allocated(device) / 2**30, 2)}))  # fmt: skip
        del model


if __name__ == "__main__":
    main()

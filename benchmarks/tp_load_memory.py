"""Host memory of each tensor-parallel rank while it loads a model on the CPU: one process per rank
builds its part of the model and loads it (what a rank does at start-up; loading runs no collective),
and reports its RSS high-water mark (VmHWM) over what it held before loading, and the time it took. The model: a random Llama of about 240M parameters saved as bf16 safetensors
in files of 100 MB (made once under --folder), or --model.

    .venv/bin/python benchmarks/tp_load_memory.py [--tp 2] [--model FOLDER]
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from pathlib import Path

CONFIG = dict(
    vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
    num_key_value_heads=4, tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
)  # fmt: skip


def status_mib(field: str) -> float:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1]) / 1024


def load_rank(folder: Path, rank: int, size: int) -> str:
    import torch

    from xinfer.distributed.group import TensorParallel, building_for
    from xinfer.loading.loader import load_config, load_model

    config = load_config(folder)
    before, start = status_mib("VmRSS:"), time.perf_counter()
    with building_for(TensorParallel(rank=rank, size=size)):
        model = load_model(folder, config, torch.device("cpu"), torch.bfloat16, "safetensors")
    seconds = time.perf_counter() - start
    held = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    peak = status_mib("VmHWM:")
    return (
        f"rank {rank}: peak RSS {peak:.0f} MiB, {peak - before:.0f} MiB over before loading; "
        f"parameters {held:.0f} MiB; loaded in {seconds:.1f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--model", type=Path, help="an HF folder (default: the random Llama under --folder)")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/xinfer-tp-load-memory"))
    args = parser.parse_args()
    folder = args.model or args.folder
    if args.model is None and not any(folder.glob("*.safetensors")):
        import torch
        from transformers import AutoModelForCausalLM, LlamaConfig

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG)).to(torch.bfloat16)
        model.save_pretrained(folder, max_shard_size="100MB")  # sharded, as released checkpoints are
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20
    print(f"checkpoint {size:.0f} MiB, tensor parallel {args.tp}")
    with multiprocessing.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:  # a fresh process per rank
        for rank in range(args.tp):
            print(pool.apply(load_rank, (folder, rank, args.tp)))


if __name__ == "__main__":
    main()

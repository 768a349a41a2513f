"""Perplexity of each ``--isq`` type against the float model it quantizes, on real weights (issue #37).

    .venv/bin/python benchmarks/isq_quality.py [--tokens 4096] [--window 1024] [--types q8_0 q4_k ...]

The float model is SmolLM2-135M-Instruct as the only real weights here hold it: its Q4_1 GGUF read by
transformers (dequantized) and saved as a float32 checkpoint, so "float" means those values; each type
quantizes that checkpoint at load (``LLM(isq=...)``) and runs on the CPU backend. The text is
kv_quality.py's (the prose of Python's language reference; its sha256 is printed), scored in independent
windows through ``prompt_logprobs``. Prints one JSON line per type and a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import tempfile
from pathlib import Path

import torch
from kv_quality import corpus
from safetensors.torch import save_file

from xinfer import LLM, SamplingParams
from xinfer.loading.resolve import resolve_model_path
from xinfer.quant.isq import isq_formats


def float_checkpoint(folder: Path) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = resolve_model_path(None)  # the embedded default's file
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tied = model.config.tie_word_embeddings  # (transformers will not save a model it read from GGUF itself)
    state = {name: t.contiguous() for name, t in model.state_dict().items() if not (tied and name == "lm_head.weight")}
    save_file(state, folder / "model.safetensors")
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the values are float now
    config["architectures"] = [type(model).__name__]
    (folder / "config.json").write_text(json.dumps(config))
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)
    return str(folder)


def perplexity(llm: LLM, tokens: list[int], window: int) -> tuple[float, int]:
    windows = [tokens[i : i + window] for i in range(0, len(tokens) - 1, window) if len(tokens[i : i + window]) > 1]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    nll, count = 0.0, 0
    for output in llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False):
        for token, entry in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:]):
            nll -= entry[token]
            count += 1
    return math.exp(nll / count), count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of the text scored")
    parser.add_argument("--window", type=int, default=1024, help="tokens per independent window")
    parser.add_argument("--types", nargs="+", default=isq_formats())
    args = parser.parse_args()
    text, digest = corpus()
    with tempfile.TemporaryDirectory() as folder:
        path = float_checkpoint(Path(folder))
        results = []
        for isq in [None, *args.types]:
            llm = LLM(model=path, dtype="float32", isq=isq, enable_prefix_caching=False, max_model_len=args.window + 1)
            tokens = llm.get_tokenizer().encode(text, add_special_tokens=False)[: args.tokens]
            ppl, scored = perplexity(llm, tokens, args.window)
            row = {"isq": isq or "float32", "ppl": ppl, "tokens": scored, "text_sha256": digest}
            if results:
                row["vs_float"] = ppl / results[0]["ppl"] - 1
            results.append(row)
            print(json.dumps(row), flush=True)
            del llm
            gc.collect()
    print("\n| isq | perplexity | vs float32 |\n|---|---|---|")
    for r in results:
        print(f"| {r['isq']} | {r['ppl']:.3f} | {100 * r['vs_float']:+.2f}% |" if "vs_float" in r
              else f"| {r['isq']} | {r['ppl']:.3f} | |")  # fmt: skip


if __name__ == "__main__":
    main()

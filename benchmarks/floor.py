"""The floor of an offline run (``offline.py --floor``): the fewest seconds its steps could take on this
device, each step bound by its FLOPs at the GEMM rate or by its bytes at the copy bandwidth, whichever
is longer, both rates measured in the same process after the run.

Per step, as the engine prepared it (its sequences' new tokens and context lengths):

- FLOPs: 2 x the linear parameters (every layer's merged qkv, o, merged gate_up and down) x the step's
  tokens; 2 x the LM head x the rows sampled (the engine takes logits only at a prompt's last token and
  at decode tokens: once per output token); attention's QK^T and PV, 2 x heads x head_dim each per key a
  query sees, a token at position p seeing the p + 1 keys up to itself.
- bytes: the weights once (:func:`shapes.weight_bytes`, the embedding rows gathered left out), the KV
  cache of the context each sequence had before the step (read) and the entries of its new tokens
  (written); activations are left out.

The sum of the steps' bounds is above the run-wide max(FLOPs / rate, bytes / bandwidth), which would let
the compute of prefill steps hide the weights and KV that decode steps read. The steps are those the run
took, not the fewest its limits allow: a step's bound needs its own tokens, which only the run's schedule
gives. ``min_steps`` (:func:`min_steps`) says how few the limits allow, so a schedule that wastes steps
shows beside the floor it raised; tokens recomputed after a preemption count as the work they were. The
tokens a backend pads a step with are not counted, and the GEMM rate is the one at the engine's largest
step (``max_num_batched_tokens`` rows): what smaller steps lose to worse GEMM shapes is left to the run.

Dense decoders only (Llama's and Qwen3's shapes): a mixture of experts reads the union of the experts
its tokens route to, which the run does not report.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from bandwidth import copy_bandwidth
from shapes import weight_bytes
from transformers import PretrainedConfig

DENSE_DECODERS = ("llama", "mistral", "qwen3")


def refusal(config: PretrainedConfig) -> str | None:
    """Why the floor cannot count ``config``'s model, or None."""
    if config.model_type not in DENSE_DECODERS:
        return f"--floor counts dense decoders ({', '.join(DENSE_DECODERS)}), not {config.model_type}"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "--floor counts full attention, not sliding windows"
    return None


def head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def linear_shapes(config: PretrainedConfig) -> list[tuple[int, int]]:
    """(out, in) of one layer's projections as the engine stores them: q, k, v merged; gate and up merged."""
    h, i, d = config.hidden_size, config.intermediate_size, head_dim(config)
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    return [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]


def linear_params(config: PretrainedConfig) -> int:
    """Parameters every token multiplies through in the layers (the LM head apart)."""
    return config.num_hidden_layers * sum(n * k for n, k in linear_shapes(config))


def lm_head_params(config: PretrainedConfig) -> int:
    return config.vocab_size * config.hidden_size


def causal_keys(new_tokens: int, context_len: int) -> int:
    """Keys the queries of positions context_len - new_tokens .. context_len - 1 see: p + 1 each."""
    start = context_len - new_tokens
    return (context_len * (context_len + 1) - start * (start + 1)) // 2


@dataclass(frozen=True)
class Step:
    """What one engine step computed, as its batch lists it (kept as is while the run is timed)."""

    cu_seqlens_q: Sequence[int]  # sequence i's new tokens are rows cu_seqlens_q[i] .. cu_seqlens_q[i + 1]
    context_lens: Sequence[int]  # each sequence's tokens after the step
    sampled: int  # rows whose logits were taken

    @property
    def new_tokens(self) -> list[int]:
        return [b - a for a, b in zip(self.cu_seqlens_q, self.cu_seqlens_q[1:])]


def step_flops(config: PretrainedConfig, step: Step) -> int:
    layers, heads, d = config.num_hidden_layers, config.num_attention_heads, head_dim(config)
    new_tokens = step.new_tokens
    keys = sum(causal_keys(new, context) for new, context in zip(new_tokens, step.context_lens))
    attention = layers * 2 * (2 * heads * d) * keys  # QK^T and PV
    return 2 * linear_params(config) * sum(new_tokens) + 2 * lm_head_params(config) * step.sampled + attention


def step_bytes(weights: int, kv_bytes_per_token: int, step: Step) -> int:
    """The weights, and each sequence's KV cache: its context before the step read, its new tokens written."""
    return weights + kv_bytes_per_token * sum(step.context_lens)


def min_steps(inputs: Sequence[int], outputs: Sequence[int], max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Fewest steps the scheduler's limits allow: a request takes its prompt's chunks, then one step per
    further output token; a step holds at most max_num_batched_tokens tokens and samples at most
    max_num_seqs rows (one per output token)."""
    one_request = max(math.ceil(p / max_num_batched_tokens) + o - 1 for p, o in zip(inputs, outputs))
    tokens = sum(p + o - 1 for p, o in zip(inputs, outputs))
    return max(one_request, math.ceil(tokens / max_num_batched_tokens), math.ceil(sum(outputs) / max_num_seqs))


@dataclass(frozen=True)
class Rates:
    flops_per_s: float
    bytes_per_s: float


def floor_seconds(flops: Sequence[int], nbytes: Sequence[int], rates: Rates) -> float:
    """Per step the longer of its FLOPs at the GEMM rate and its bytes at the bandwidth, summed."""
    return sum(max(f / rates.flops_per_s, b / rates.bytes_per_s) for f, b in zip(flops, nbytes))


def record_steps(runner) -> list[Step]:
    """Wraps ``runner.prepare`` to keep each step's token counts (references to the batch's lists: nothing
    is computed while the run is timed); clear the list between runs."""
    steps: list[Step] = []
    inner = runner.prepare

    def prepare(scheduled):
        batch = inner(scheduled)
        steps.append(Step(batch.cu_seqlens_q, batch.seq_lens, len(batch.sample_rows)))
        return batch

    runner.prepare = prepare
    return steps


def best_seconds(fn: Callable[[], object], device: torch.device, reps: int = 10) -> float:
    """The fastest of ``reps`` calls after a warm-up call: CUDA events on a GPU, the host clock on a CPU
    (which computes as it is called)."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return min(times)


def gemm_rate(config: PretrainedConfig, m: int, dtype: torch.dtype, device: torch.device, reps: int = 10) -> float:
    """FLOPs per second of ``torch.matmul`` through one layer's projections for ``m`` tokens."""
    shapes = linear_shapes(config)
    seconds = sum(matmul_seconds(m, n, k, dtype, device, reps) for n, k in shapes)
    return sum(2 * m * n * k for n, k in shapes) / seconds


def matmul_seconds(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, reps: int) -> float:
    """[m, k] activations times an [n, k] weight, as a linear layer multiplies them."""
    x = torch.randn(m, k, dtype=dtype, device=device)
    w = torch.randn(n, k, dtype=dtype, device=device)
    out = torch.empty(m, n, dtype=dtype, device=device)
    return best_seconds(lambda: torch.matmul(x, w.t(), out=out), device, reps)


def bandwidth(device: torch.device) -> float:
    """Copy bandwidth; on a GPU in buffers of at most 4 GiB, a third of the memory the engine left free."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return copy_bandwidth(min(4.0, free / 3 / 2**30))
    src = torch.randn(2**24, device=device)  # 64 MiB, beyond any CPU cache
    dst = torch.empty_like(src)
    return 2 * src.nbytes / best_seconds(lambda: dst.copy_(src), device, reps=5)


def measure_rates(config: PretrainedConfig, m: int, dtype: torch.dtype, device: torch.device) -> Rates:
    return Rates(gemm_rate(config, m, dtype, device), bandwidth(device))


def report(
    config: PretrainedConfig,
    steps: Sequence[Step],
    itemsize: int,
    kv_bytes_per_token: int,
    rates: Rates,
    output_tokens: int,
    seconds: float,
) -> dict:
    """A run's floor beside what it achieved in ``seconds``."""
    weights = weight_bytes(config, itemsize)
    flops = [step_flops(config, step) for step in steps]
    nbytes = [step_bytes(weights, kv_bytes_per_token, step) for step in steps]
    floor = floor_seconds(flops, nbytes, rates)
    return {
        "floor_s": round(floor, 3),
        "floor_output_tok_s": round(output_tokens / floor, 2),
        "fraction_of_floor": round(floor / seconds, 3),
        "flops": sum(flops),
        "bytes": sum(nbytes),
        "engine_steps": len(steps),
    }

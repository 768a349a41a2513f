"""Token choice for a batch of sequences, from their last-position logits.

Order: penalties, then greedy rows take the argmax; the others are divided by
their temperature, filtered by top-k, top-p and min-p, and sampled. Sampling is
``argmax(p / e)`` with ``e ~ Exp(1)`` (equivalent to drawing from ``p``); a seeded
request draws ``e`` from a generator keyed by (seed, output position), so its
tokens do not depend on what else is in the batch or on preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from xinfer.engine.sequence import Sequence


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # chosen token and the top-N, per row


class SampledTokens:
    """A step's sampled tokens, still on the device (where the next step can read them
    as inputs) and on their way to the host: the copies are issued with the sampling,
    so :meth:`result` waits for this step only, not for steps launched after it."""

    def __init__(self, seqs: list[Sequence], tokens: Tensor, logprobs: Tensor | None):
        self.seqs, self.tokens = seqs, tokens
        self.num_top = [s.params.logprobs for s in seqs]
        found = [tokens]
        if logprobs is not None:
            found.append(logprobs.gather(1, tokens[:, None]).squeeze(1))
            most = max(n or 0 for n in self.num_top)
            if most:
                top = logprobs.topk(most)
                found += [top.indices, top.values]
        self._host = [_to_host(t) for t in found]
        self._copied = None if tokens.device.type == "cpu" else torch.Event(device=tokens.device)
        if self._copied is not None:
            self._copied.record()

    def result(self) -> SamplerOutput:
        if self._copied is not None:
            self._copied.synchronize()
        token_ids, *found = [t.tolist() for t in self._host]
        logprobs: list[dict[int, float] | None] = [None] * len(token_ids)
        if found:
            chosen, *top = found
            for row, n in enumerate(self.num_top):
                if n is not None:
                    entry = {token_ids[row]: chosen[row]}
                    if n:
                        entry.update(zip(top[0][row][:n], top[1][row][:n]))
                    logprobs[row] = entry
        return SamplerOutput(token_ids, logprobs)


def _to_host(t: Tensor) -> Tensor:
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device).manual_seed(seed)

    def __call__(self, logits: Tensor, seqs: list[Sequence]) -> SampledTokens:
        wants_logprobs = any(s.params.logprobs is not None for s in seqs)
        if wants_logprobs or any(s.params.has_penalties or not s.params.greedy for s in seqs):
            logits = logits.float()  # else greedy picks alone: the argmax of the model's own logits
        raw_logprobs = logits.log_softmax(-1) if wants_logprobs else None
        logits = apply_penalties(logits, seqs)
        logits = mask_stop_tokens_before_min_tokens(logits, seqs)
        tokens = logits.argmax(-1)
        sampled_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=logits.device)
            probs = filtered_probs(logits[rows], [seqs[i] for i in sampled_rows])
            noise = torch.stack([self._exponential(seqs[i], probs) for i in sampled_rows])
            tokens[rows] = (probs / noise).argmax(-1)
        return SampledTokens(seqs, tokens, raw_logprobs)

    def _exponential(self, seq: Sequence, like: Tensor) -> Tensor:
        generator = self.generator
        if seq.params.seed is not None:
            key = hash((seq.params.seed, seq.num_output_tokens)) & (2**63 - 1)
            generator = torch.Generator(like.device).manual_seed(key)
        return torch.empty(like.shape[-1], device=like.device).exponential_(generator=generator)


def apply_penalties(logits: Tensor, seqs: list[Sequence]) -> Tensor:
    """Repetition penalty (HF: over prompt and output), presence and frequency
    penalties (OpenAI: over the output)."""
    for row, seq in enumerate(seqs):
        p = seq.params
        if not p.has_penalties:
            continue
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=logits.device)
            values = logits[row, seen]
            logits[row, seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if seq.num_output_tokens and (p.presence_penalty or p.frequency_penalty):
            output = torch.tensor(seq.output_token_ids, device=logits.device)
            counts = torch.bincount(output, minlength=logits.shape[-1])
            counts = counts[: logits.shape[-1]].to(logits.dtype)
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def mask_stop_tokens_before_min_tokens(logits: Tensor, seqs: list[Sequence]) -> Tensor:
    for row, seq in enumerate(seqs):
        if seq.num_output_tokens < seq.params.min_tokens:
            stops = seq.params.stop_token_ids + sorted(seq.eos_token_ids)
            if stops:
                logits[row, stops] = float("-inf")
    return logits


def filtered_probs(logits: Tensor, seqs: list[Sequence]) -> Tensor:
    def column(values: list) -> Tensor:
        return torch.tensor(values, device=logits.device).unsqueeze(1)

    temperature = column([s.params.temperature for s in seqs])
    logits = logits / temperature
    top_k = [s.params.top_k for s in seqs]
    if any(top_k):
        k = column([min(k, logits.shape[-1]) or logits.shape[-1] for k in top_k])
        kth = logits.sort(dim=-1, descending=True).values.gather(1, k - 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if any(s.params.top_p < 1 for s in seqs):
        top_p = column([s.params.top_p for s in seqs])
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(1, order, sorted_probs)
    if any(s.params.min_p > 0 for s in seqs):
        min_p = column([s.params.min_p for s in seqs])
        probs = probs.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, 0.0)
    return probs

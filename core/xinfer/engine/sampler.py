"""Token choice for a batch of sequences, from their last-position logits.

The draw itself is one backend op over the whole batch (:meth:`xinfer.ops.Ops.sample`,
defined by :mod:`xinfer.torch_sampling`), which a backend that records steps runs
inside the step's recording. Logit biases, then penalties (in the order of transformers'
and vLLM's processors), and min_tokens change the logits first; a batch with any of them
is sampled here, after the step, from the adjusted logits.
Logprobs are of the model's own distribution, before penalties. A row with a grammar
(structured outputs) has the tokens its grammar forbids masked out after the penalties
(:func:`apply_grammar_masks`, the one place masks are applied); a batch without any
grammar builds no mask at all.

Every request draws its noise from its seed and the position of the token drawn, so
its tokens do not depend on what else is in the batch or on preemption; a request
without a seed gets one from the engine's generator when it is added.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from xinfer import logprob, ops
from xinfer.engine.sequence import Sequence
from xinfer.logprob import Logprob
from xinfer.sampling import SampledRow, SamplingBatch

if TYPE_CHECKING:
    from xinfer.grammar.matcher import Constraint


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]  # chosen token and the top-N, per row


class SampledTokens:
    """A step's sampled tokens, still on the device (where the next step can read them
    as inputs) and on their way to the host: the copies are issued with the sampling,
    so :meth:`result` waits for this step only, not for steps launched after it."""

    def __init__(self, seqs: list[Sequence], tokens: Tensor, logprobs: Tensor | None):
        self.seqs, self.tokens = seqs, tokens
        self.failures: list[tuple[Sequence, Exception]] = []  # sequences of the step whose draw failed, left out
        self.num_top = [s.params.logprobs for s in seqs]
        found = [tokens]
        if logprobs is not None:
            found += logprob.chosen_and_ranks(logprobs, tokens)
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
        logprobs: list[dict[int, Logprob] | None] = [None] * len(token_ids)
        if found:
            chosen, ranks, *top = found
            for row, n in enumerate(self.num_top):
                if n is not None:
                    top_ids, top_values = (top[0][row][:n], top[1][row][:n]) if n else ([], [])
                    logprobs[row] = logprob.entry(token_ids[row], chosen[row], ranks[row], top_ids, top_values)
        return SamplerOutput(token_ids, logprobs)


def _to_host(t: Tensor) -> Tensor:
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.seeds = random.Random(seed)

    def new_seed(self) -> int:
        """A seed for a request that brings none (drawn on the host: no device sync)."""
        return self.seeds.getrandbits(63)

    @staticmethod
    def rows(seqs: list[Sequence]) -> list[SampledRow]:
        # a sequence built outside the engine (profiling, tests) may have no seed: 0
        return [SampledRow(s.params, s.params.seed or 0, s.num_tokens) for s in seqs]

    def __call__(self, logits: Tensor, seqs: list[Sequence], tokens: Tensor | None = None) -> SampledTokens:
        """The tokens of ``seqs`` from their ``logits``; ``tokens``: already drawn from
        these logits with :meth:`rows` (inside a recorded step), unless penalties or
        min_tokens change the logits first. Sequences whose own draw fails are left out,
        in :attr:`SampledTokens.failures`."""
        try:
            return self._draw(logits, seqs, tokens)
        except Exception as error:  # noqa: BLE001 - a request's parameters or grammar, or the batch's: found below
            return self._without_failing_rows(logits, seqs, tokens, error)

    def _draw(self, logits: Tensor, seqs: list[Sequence], tokens: Tensor | None) -> SampledTokens:
        wants_logprobs = any(s.params.logprobs is not None for s in seqs)
        raw_logprobs = logits.float().log_softmax(-1) if wants_logprobs else None
        if any(adjusts_logits(s) for s in seqs):
            logits = logits.to(torch.float32, copy=True)
            logits = apply_penalties(apply_logit_bias(logits, seqs), seqs)
            logits = keep_allowed_tokens(mask_stop_tokens_before_min_tokens(ban_bad_words(logits, seqs), seqs), seqs)
            tokens = None
        constrained = [(row, s.constraint) for row, s in enumerate(seqs) if s.constraint is not None and wants_mask(s)]
        if constrained:
            apply_grammar_masks(logits, constrained)
            tokens = None
        if tokens is None:
            tokens = ops.sample(logits, SamplingBatch.of(self.rows(seqs)).to(logits.device))
        return SampledTokens(seqs, tokens, raw_logprobs)

    def _without_failing_rows(
        self, logits: Tensor, seqs: list[Sequence], tokens: Tensor | None, error: Exception
    ) -> SampledTokens:
        """After a draw failed: each row drawn alone (from a copy: grammar masks are applied in place) finds
        the sequences whose own draw fails; the others are drawn again together. A draw depends only on its
        row's logits, seed and position, so they get the tokens they would have had. Where no row fails
        alone, or every row does and so does a plain greedy draw of the same logits (the op itself, a device
        error), the batch failed: ``error`` is raised."""
        failures: list[tuple[Sequence, Exception]] = []
        for row, seq in enumerate(seqs):
            try:
                self._draw(logits[row : row + 1].clone(), [seq], None if tokens is None else tokens[row : row + 1])
            except Exception as failure:  # noqa: BLE001 - that sequence's own
                failures.append((seq, failure))
        if not failures or (len(failures) == len(seqs) and not draws_plainly(logits)):
            raise error
        failed = {id(seq) for seq, _ in failures}
        kept = [row for row, seq in enumerate(seqs) if id(seq) not in failed]
        index = torch.tensor(kept, dtype=torch.int64, device=logits.device)
        if kept:
            sampled = self._draw(logits.index_select(0, index), [seqs[row] for row in kept],
                                 None if tokens is None else tokens.index_select(0, index))  # fmt: skip
        else:
            sampled = SampledTokens([], index, None)
        sampled.failures = failures
        return sampled


def draws_plainly(logits: Tensor) -> bool:
    """Whether the sample op draws a token from ``logits``' first row with no parameter of any request (greedy,
    no grammar, penalty or bias): where it does, rows that each failed alone failed by their own."""
    try:
        ops.sample(logits[:1].clone(), SamplingBatch.of([], num_rows=1).to(logits.device))
    except Exception:  # noqa: BLE001 - the op or the device, whatever it raised
        return False
    return True


def wants_mask(seq: Sequence) -> bool:
    return seq.constraint is not None and not seq.finished and seq.constraint.wants_mask


def apply_grammar_masks(logits: Tensor, constrained: list[tuple[int, Constraint]]) -> None:
    """The grammar masks of the constrained rows, computed on the host (their matchers
    have followed every earlier token), then applied on the device in one op."""
    from xinfer.grammar.matcher import fill_bitmask

    bitmask = fill_bitmask([constraint for _, constraint in constrained])
    rows = torch.tensor([row for row, _ in constrained], dtype=torch.int64)
    ops.apply_token_bitmask(logits, bitmask.to(logits.device, non_blocking=True), rows.to(logits.device))


def adjusts_logits(seq: Sequence) -> bool:
    p = seq.params
    return (p.has_penalties or bool(p.logit_bias) or p.allowed_token_ids is not None or bool(seq.bad_word_ids)
            or seq.num_output_tokens < p.min_tokens)  # fmt: skip


def reads_earlier_tokens(seq: Sequence) -> bool:
    """Whether drawing its next token reads its tokens so far (penalties count them, a bad word's ban follows
    them): its last token must be on the host before the draw, not pending on the device."""
    return seq.params.has_penalties or bool(seq.bad_word_ids)


def apply_penalties(logits: Tensor, seqs: list[Sequence]) -> Tensor:
    """Repetition penalty (HF: over prompt and output), presence and frequency
    penalties (OpenAI: over the output), for the whole batch at once."""
    rows, vocab = logits.shape
    seen, output = [], []  # flat indices row * vocab + token
    for row, seq in enumerate(seqs):
        p = seq.params
        if p.repetition_penalty != 1.0:
            seen += [row * vocab + t for t in set(seq.token_ids)]
        if p.presence_penalty or p.frequency_penalty:
            output += [row * vocab + t for t in seq.output_token_ids]
    if seen:
        penalty = column([s.params.repetition_penalty for s in seqs], logits.device)
        was_seen = torch.zeros(rows * vocab, dtype=torch.bool, device=logits.device)
        was_seen[torch.tensor(seen, device=logits.device)] = True
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(was_seen.view(rows, vocab), penalized, logits)
    if output:
        counts = torch.bincount(torch.tensor(output, device=logits.device), minlength=rows * vocab)
        counts = counts.view(rows, vocab).to(logits.dtype)
        frequency = column([s.params.frequency_penalty for s in seqs], logits.device)
        presence = column([s.params.presence_penalty for s in seqs], logits.device)
        logits = logits - frequency * counts - presence * (counts > 0).to(logits.dtype)
    return logits


def apply_logit_bias(logits: Tensor, seqs: list[Sequence]) -> Tensor:
    """Each row's ``logit_bias`` added to the logits of its tokens."""
    vocab = logits.shape[-1]
    flat = [(row * vocab + t, b) for row, s in enumerate(seqs) for t, b in (s.params.logit_bias or {}).items()]
    if flat:
        index, bias = zip(*flat)
        logits.view(-1).index_add_(
            0, torch.tensor(index, device=logits.device), torch.tensor(bias, dtype=logits.dtype, device=logits.device)
        )
    return logits


def bad_word_token_ids(words: list[str], tokenizer: Any, vocab_size: int) -> list[tuple[int, ...]]:
    """The token sequences that write each of ``words`` (vLLM's ``bad_words``): the word alone, and after a space
    where that is other tokens of the same count (a word inside a text is often one token with its space).
    Sequences ending in a token the model cannot generate are left out."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        sequences.append(alone)
        if spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
    return [ids for ids in sequences if ids and ids[-1] < vocab_size]


def ban_bad_words(logits: Tensor, seqs: list[Sequence]) -> Tensor:
    """Each row's bad words: the last token of each whose other tokens the output ends with, -inf (a one-token
    word always)."""
    vocab = logits.shape[-1]
    banned = [
        row * vocab + ids[-1]
        for row, seq in enumerate(seqs)
        for ids in seq.bad_word_ids
        if len(ids) == 1 or tuple(seq.output_token_ids[-(len(ids) - 1) :]) == ids[:-1]
    ]
    if banned:
        logits.view(-1)[torch.tensor(banned, device=logits.device)] = float("-inf")
    return logits


def keep_allowed_tokens(logits: Tensor, seqs: list[Sequence]) -> Tensor:
    """Each row with ``allowed_token_ids``: every other token's logit -inf (one index copy a step, as the
    logit bias's)."""
    vocab = logits.shape[-1]
    rows = [row for row, s in enumerate(seqs) if s.params.allowed_token_ids is not None]
    if rows:
        flat = [row * vocab + t for row in rows for t in seqs[row].params.allowed_token_ids or ()]
        index = torch.tensor(flat, device=logits.device)
        kept = logits.view(-1)[index]
        logits[rows] = float("-inf")
        logits.view(-1)[index] = kept
    return logits


def mask_stop_tokens_before_min_tokens(logits: Tensor, seqs: list[Sequence]) -> Tensor:
    vocab = logits.shape[-1]
    masked = [
        row * vocab + t
        for row, seq in enumerate(seqs)
        if seq.num_output_tokens < seq.params.min_tokens
        for t in seq.params.stop_token_ids + sorted(seq.eos_token_ids)
        if t < vocab
    ]
    if masked:
        logits.view(-1)[torch.tensor(masked, device=logits.device)] = float("-inf")
    return logits


def column(values: list[float], device: torch.device) -> Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]

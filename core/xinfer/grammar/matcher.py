"""A constraint's state in one sequence, and the masks of a step's constrained rows.

The engine builds one :class:`GrammarCompiler` per tokenizer (llguidance's view of the
vocabulary: about a second for a large one, so only when a first request asks for a
constraint). Each constrained sequence holds a :class:`Constraint`, which follows the
tokens the sequence accepts; :func:`fill_bitmask` writes the allowed-token bitmask of a
batch of them, on host threads that release the GIL (while the device runs the step's
forward).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Sequence
from typing import Any

import llguidance
import llguidance.torch as llguidance_torch
import torch
from torch import Tensor

from xinfer import ops
from xinfer.grammar.spec import StructuredOutputs, one_line


class GrammarCompiler:
    """Compiles constraints for one tokenizer; ``vocab_size`` is the model's logits width."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]):
        backend = getattr(tokenizer, "backend", None)
        if backend is None:
            raise ValueError("structured outputs need the model's tokenizer (this model has none)")
        eos = sorted(eos_token_ids)
        if not eos:
            raise ValueError("structured outputs need an end-of-sequence token, and this model declares none")
        width = max(vocab_size, tokenizer.vocab_size)
        self.tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=width, eos_token=eos)
        self.vocab_size = vocab_size
        self.words = (width + 31) // 32  # int32 words of a bitmask row

    def compile(self, spec: StructuredOutputs) -> Constraint:
        matcher = llguidance.LLMatcher(self.tokenizer, spec.lark_or_llguidance, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {spec.kind}: {one_line(matcher.get_error())}")
        return Constraint(matcher, self.words, spec.after_token_id)


class Constraint:
    """The grammar state of one sequence. Before ``after_token_id`` has been generated
    (the end of reasoning) the constraint is dormant: no mask, tokens not followed."""

    def __init__(self, matcher: llguidance.LLMatcher, words: int, after_token_id: int | None = None):
        self.matcher, self.words = matcher, words
        self.after_token_id = after_token_id
        self.active = after_token_id is None

    def accept(self, token: int) -> None:
        """Follows a generated token (one the mask allowed, once active)."""
        if not self.active:
            self.active = token == self.after_token_id
            return
        if not self.matcher.is_stopped() and not self.matcher.consume_token(token):
            raise ValueError(
                f"the constraint allows no token here (token {token} was drawn): the request's other token filters "
                "(allowed_token_ids, bad_words, logit_bias) leave none of those it allows"
            )

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more: the sequence ends here."""
        return self.active and self.matcher.is_stopped()

    @property
    def wants_mask(self) -> bool:
        return self.active and not self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


def fill_bitmask(constraints: Sequence[Constraint]) -> Tensor:
    """The allowed-token bitmask [len(constraints), words] (int32, bit ``t % 32`` of word
    ``t // 32`` set: token ``t`` allowed) of constraints of one compiler, in a host buffer of
    the backend in use (to be copied to its device)."""
    bitmask = ops.current().host_buffer((len(constraints), constraints[0].words), torch.int32)
    pairs = [(c.matcher, row) for row, c in enumerate(constraints)]
    llguidance_torch.fill_next_token_bitmask_par(_executor(), pairs, bitmask)
    return bitmask


@functools.cache
def _executor() -> llguidance.LLExecutor:
    """Threads that compute masks (one per core, the GIL released)."""
    return llguidance.LLExecutor(num_threads=max(1, min(32, os.cpu_count() or 1)))

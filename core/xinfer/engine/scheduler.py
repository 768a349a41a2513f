"""Continuous batching: which sequences run this step, and how many tokens each.

Every step has a token budget. Running sequences go first (one token each when
decoding, a chunk when still prefilling), then waiting ones join while budget,
blocks and ``max_num_seqs`` allow. When blocks run out, the most recently started
sequence is preempted: its blocks are freed and it is recomputed later. A prompt's
chunks end where the cache snapshots recurrent state (:meth:`CacheManager.next_snapshot`).

A model with a context switch (``CausalLM.context_switch``: LongRoPE's trained context) computes
the KV of a prompt longer than it otherwise, at every position, as transformers' ``generate`` does
whatever the chunks: a longer prompt's chunks end past it (over any state snapshot point up to it), a shorter
one's stop at it, and the prefix-cache
blocks of a longer one are its own (:attr:`Sequence.long_context`). A sequence that grows past it
while generating turns its new tokens the long way; where the model recomputes then
(``CausalLM.recompute_past_switch``, as transformers' Phi-3), it is recomputed from its first token.

A step that carries prompt tokens costs more than a pure decode step even when it
replays a graph (its GEMMs are compute-bound, and it is padded to a token bucket);
so once the batch is nearly full, waiting prompts
are admitted in groups (when an eighth of the sequence slots are free, or when they
would fill the token budget) rather than one per finished sequence; but never after the
first of them has waited that many steps: requests that arrive one by one (a server's)
would otherwise each wait for a group to form, their slots idle meanwhile. (Measured when
such steps were eager; with step graphs the group size wants re-measuring.)
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from xinfer.cache.manager import CacheManager
from xinfer.config import SchedulerConfig
from xinfer.engine.sequence import Sequence, Status


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def context_len(self) -> int:
        """The tokens this step's attention reads: those already cached and its new ones."""
        return self.seq.num_computed_tokens + self.num_new_tokens

    @property
    def completes_prompt(self) -> bool:
        """Whether this step computes the sequence's last token, so it samples the next."""
        return self.context_len == self.seq.num_tokens


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        cache: CacheManager,
        context_switch: int | None = None,
        recompute_past_switch: bool = False,
    ):
        if config.max_num_seqs is None:
            raise ValueError("max_num_seqs is not set (the engine sets it from its memory plan)")
        self.config = config
        self.max_num_seqs = config.max_num_seqs
        self.cache = cache
        self.context_switch = context_switch
        self.recompute_past_switch = recompute_past_switch
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_steps = self.num_step_sequences = self.num_step_tokens = 0  # over every step scheduled

    def add(self, seq: Sequence) -> None:
        seq.queued_at_step = self.num_steps
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted = False
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING or seq.at_limit:  # preempted below, or done when read back
                continue
            if self._long(seq) and not seq.long_context:  # its cache holds the KV of a shorter sequence
                self._restart(seq)
                continue
            num_new = 1 if seq.num_computed_tokens + 1 == len(seq.token_ids) else self._chunk(seq, budget)
            if num_new == 0:  # the rest of an image its tokens must see whole does not fit this step
                continue
            while not self.cache.allocate(seq, seq.num_computed_tokens + num_new):
                preempted = True
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
        carries_prompt = any(not s.completes_prompt or s.num_new_tokens > 1 for s in scheduled)
        while self.waiting and budget > 0 and not preempted and (carries_prompt or self._admitting()):
            if len(self.running) >= self.max_num_seqs:
                break
            seq = self.waiting[0]
            if not self.cache.holds(seq):
                seq.long_context = self._long(seq)
                seq.num_computed_tokens = self.cache.match_prefix(seq)
                if not seq.scheduled_once:
                    seq.num_cached_tokens = seq.num_computed_tokens
            num_new = self._chunk(seq, budget)
            if num_new == 0 or not self.cache.allocate(seq, seq.num_computed_tokens + num_new):
                self.cache.release(seq)
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            seq.status, seq.scheduled_once = Status.RUNNING, True
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, num_new))
            carries_prompt = carries_prompt or num_new > 1 or not scheduled[-1].completes_prompt
            budget -= num_new
        if scheduled:
            self.num_steps += 1
            self.num_step_sequences += len(scheduled)
            self.num_step_tokens += self.config.max_num_batched_tokens - budget
        return scheduled

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """The tokens ``seq`` computes this step: the rest, within the budget, up to the next
        point where its recurrent state is snapshotted (models with recurrent layers), not
        ending inside an image whose tokens see each other (:meth:`Sequence.chunk_end`)."""
        start = seq.num_computed_tokens
        most = min(seq.num_uncomputed_tokens, budget)
        end = start + min(most, self.cache.next_snapshot(seq) - start)
        switch = self.context_switch
        if seq.long_context and switch is not None and end <= switch:
            end = start + most  # a snapshot point up to the switch is skipped: the chunk must reach past it
            if end <= switch < start + self.config.max_num_batched_tokens:
                return 0  # a longer chunk waits for the budget: one ending before the switch would compute short KV
        if not seq.long_context and switch is not None and start < switch < end:
            end = switch  # the tokens up to the switch are a short sequence's, turned the short way
        return seq.chunk_end(start, end) - start

    def _long(self, seq: Sequence) -> bool:
        """Whether ``seq``'s KV is the long kind at every position: it is longer than the model's context
        switch (its prompt is, where a sequence growing past it keeps the keys cached before)."""
        length = seq.num_tokens if self.recompute_past_switch else seq.num_prompt_tokens
        return self.context_switch is not None and length > self.context_switch

    def _admitting(self) -> bool:
        """Whether a step that carries no prompt tokens yet admits waiting ones."""
        group = max(1, self.max_num_seqs // 8)
        free_slots = self.max_num_seqs - len(self.running)
        waiting_tokens = sum(s.num_uncomputed_tokens for s in self.waiting)
        return (
            not self.running
            or free_slots >= group
            or self.num_steps - self.waiting[0].queued_at_step >= group
            or waiting_tokens >= self.config.max_num_batched_tokens
        )

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` (stopped, aborted or failed) and free its blocks."""
        seq.status, seq.finish_reason = Status.FINISHED, reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.cache.release(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._restart(seq)
        self.num_preemptions += 1

    def _restart(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and put it first in line, to compute again from its first token."""
        self.running.remove(seq)
        self.cache.release(seq)
        seq.status, seq.num_computed_tokens, seq.queued_at_step = Status.WAITING, 0, self.num_steps
        self.waiting.appendleft(seq)

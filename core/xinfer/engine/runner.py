"""One engine step on the device: flatten the scheduled sequences into a batch
(longest context first), run the model and sample the sequences that completed their
prompt (a replay of a recorded step, forward and sampling, where the backend records
them).

A step is launched without waiting for the one before: a sequence's last token may
still be on the device (:data:`~xinfer.engine.sequence.PENDING` on the host), and
then the step reads it from the sampled tokens of the step before."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from xinfer import logprob, ops
from xinfer.cache.state_pool import copy_slots
from xinfer.engine.failures import RequestFailed
from xinfer.engine.sampler import SampledTokens, Sampler
from xinfer.engine.scheduler import ScheduledSeq
from xinfer.engine.sequence import PENDING
from xinfer.forward_context import forward_context
from xinfer.logprob import Logprob
from xinfer.model import CausalLM
from xinfer.multimodal.encoder_cache import EncoderCache
from xinfer.multimodal.step import MultiModalEmbeddings, MultiModalSlice, gather_embeddings, slices_of
from xinfer.ops import AttentionMetadata, DeviceTokens, HostBatch, Ops, PageBatch, StepContext, StepLimits, StepRunner

if TYPE_CHECKING:
    from xinfer.distributed.ranks import Ranks


LOGPROB_ROWS = 256


def longest_first(scheduled: list[ScheduledSeq]) -> list[ScheduledSeq]:
    """The step's sequences by context length, longest first. Attention work grows with
    the context; a backend that gives each sequence its own programs, launched in row
    order, then starts the longest first and ends with short ones instead of waiting
    on a long one started last (longest-processing-time-first scheduling)."""
    return sorted(scheduled, key=lambda item: item.context_len, reverse=True)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        backend: Ops,
        block_size: int,
        device: torch.device,
        seed: int = 0,
        num_page_groups: int = 1,
        has_state: bool = False,
        encoder_cache_size: int = 0,
    ):
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.num_page_groups = num_page_groups
        self.has_state = has_state
        self.sampler = Sampler(device, seed)
        self.graphs: StepRunner | None = None
        self.ranks: Ranks | None = None  # under tensor parallelism, once built
        self.state_caches: list[dict[str, Tensor]] = []  # each recurrent layer's state tensors, once allocated
        self.state_copies: list[tuple[int, int]] = []  # under tensor parallelism: the other ranks' to make
        self.encoder_cache = EncoderCache(encoder_cache_size)

    @torch.inference_mode()
    def capture_graphs(
        self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, shadows: bool = False
    ) -> None:
        """Let the backend record steps (CUDA graphs) if it can: a step replayed costs
        a few launches instead of hundreds."""
        capture = getattr(self.backend, "capture_steps", None)
        if capture is not None:
            max_blocks = -(-max_model_len // self.block_size)
            limits = StepLimits(max_num_seqs, max_num_batched_tokens, max_blocks, max_model_len,
                                self.num_page_groups, shadows, self.has_state)  # fmt: skip
            with ops.use(self.backend):
                self.graphs = capture(self.forward, limits, self.device)

    def forward(self, input_ids: Tensor, positions: Tensor, step: StepContext, sample_rows: Tensor) -> Tensor:
        """Logits of the rows ``sample_rows`` of a step (:meth:`CausalLM.compute_logits`)."""
        with forward_context(step):
            hidden = self.model(input_ids, positions)
            return self.model.compute_logits(hidden.index_select(0, sample_rows))

    def logits(self, input_ids: Tensor, positions: Tensor, step: StepContext) -> Tensor:
        """fp32 logits of every row of a step (scoring)."""
        with forward_context(step):
            return self.model.compute_logits(self.model(input_ids, positions)).float()

    @torch.inference_mode()
    def hidden_states(self, batch: HostBatch) -> Tensor:
        """The model's final hidden states over every token of ``batch``."""
        with ops.use(self.backend), self._leading(("hidden", batch)):
            input_ids, positions, step = self.to_device(batch)
            with forward_context(step):
                return self.model(input_ids, positions)

    @torch.inference_mode()
    def prompt_logprobs(self, batch: HostBatch, following: list[int], top_n: int) -> list[dict[int, Logprob]]:
        """For ``batch``, a step of one sequence: the log-probability of each token of ``following`` (the
        token after each row, as far as the sequence goes) after its row, with the ``top_n`` likeliest
        tokens there. The logits are taken ``LOGPROB_ROWS`` rows at a time (a long step's [T, vocab]
        would not fit)."""
        with ops.use(self.backend), self._leading(("logprobs", batch, following, top_n)):
            input_ids, positions, step = self.to_device(batch)
            entries: list[dict[int, Logprob]] = []
            with forward_context(step):
                hidden = self.model(input_ids, positions)
                for start in range(0, len(following), LOGPROB_ROWS):
                    tokens = following[start : start + LOGPROB_ROWS]
                    logprobs = self.model.compute_logits(hidden[start : start + len(tokens)]).float().log_softmax(-1)
                    chosen, ranks = logprob.chosen_and_ranks(logprobs, self._tensor(tokens, torch.int64))
                    top = logprobs.topk(top_n)  # (top_n 0: empty rows)
                    for token, value, rank, ids, values in zip(tokens, chosen.tolist(), ranks.tolist(),
                                                               top.indices.tolist(), top.values.tolist()):  # fmt: skip
                        entries.append(logprob.entry(token, value, rank, ids, values))
            return entries

    @torch.inference_mode()
    def step(
        self,
        scheduled: list[ScheduledSeq],
        previous: SampledTokens | None = None,
        before_sampling: Callable[[], None] | None = None,
    ) -> SampledTokens | None:
        """Launches a step; returns the tokens of the sequences that sample one, still on
        their way to the host. ``previous`` holds the tokens this step's pending inputs are.
        ``before_sampling`` runs on the host once the forward is launched, while the device
        runs it (grammar masks need the tokens of ``previous`` read back first)."""
        scheduled = longest_first(scheduled)
        batch = self.prepare(scheduled)
        sampling = [s.seq for s in scheduled if s.completes_prompt]
        with ops.use(self.backend):
            pending = self._pending_inputs(scheduled, batch, previous)
            graphs = self.graphs if not batch.multimodal else None  # steps with image embeddings run eagerly
            stepped = graphs(batch, pending, self.sampler.rows(sampling)) if graphs else None
            if stepped is None:
                with self._leading(("step", batch, pending is not None)):
                    logits, tokens = self.eager_forward(batch, pending, share_inputs=pending is not None), None
            else:
                logits, tokens = stepped
            if before_sampling is not None:
                before_sampling()
            return self.sampler(logits, sampling, tokens) if sampling else None

    def eager_forward(self, batch: HostBatch, pending: DeviceTokens | None, share_inputs: bool = False) -> Tensor:
        """Logits of ``batch``'s sampled rows, run eagerly, ``pending`` written into its input ids; with
        ``share_inputs``, under tensor parallelism, every rank's input ids are the first rank's."""
        rows = self._tensor(batch.sample_rows, torch.int64)
        input_ids, positions, step = self.to_device(batch)
        if pending is not None:
            pending.write_into(input_ids)
        if share_inputs and self.ranks is not None:
            self.ranks.share(input_ids)
        return self.forward(input_ids, positions, step, rows)

    def copy_state_slot(self, source: int, target: int) -> None:
        """State slot ``source`` copied into ``target`` over every recurrent layer: here now (on the device, after
        the step in flight), on the other ranks before their next forward (the first rank's scheduler decides
        every rank's slots)."""
        copy_slots(self.state_caches, [(source, target)])
        if self.ranks is not None:
            self.state_copies.append((source, target))

    @contextlib.contextmanager
    def _leading(self, message: tuple) -> Iterator[None]:
        """Under tensor parallelism, on the first rank: the other ranks are sent ``message`` (what to run
        alongside) and the state copies to make first, and a rank that fails meanwhile raises
        :class:`~xinfer.distributed.WorkerFailed`."""
        if self.ranks is None or not self.ranks.tp.first:
            yield
            return
        self.ranks.send((*message, self.state_copies))
        self.state_copies = []
        with self.ranks.failing_as_workers():
            yield

    def _pending_inputs(
        self, scheduled: list[ScheduledSeq], batch: HostBatch, previous: SampledTokens | None
    ) -> DeviceTokens | None:
        """Where ``batch``'s input ids are tokens the step before sampled and the host has
        not read yet (only ever a sequence's last token)."""
        rows = {id(seq): row for row, seq in enumerate(previous.seqs)} if previous is not None else {}
        index, source = [], []
        for item, end in zip(scheduled, batch.cu_seqlens_q[1:]):
            if batch.input_ids[end - 1] == PENDING:
                index.append(end - 1)
                source.append(rows[id(item.seq)])
        if not index:
            return None
        assert previous is not None
        index_and_source = self._tensor([index, source], torch.int64)  # one copy to the device
        return DeviceTokens(index_and_source[0], previous.tokens.index_select(0, index_and_source[1]))

    def prepare(self, scheduled: list[ScheduledSeq]) -> HostBatch:
        """The host's flat batch of ``scheduled``; raises :class:`RequestFailed` naming the sequence whose
        packing failed (nothing is launched yet: the step can be packed again without it)."""
        batch = HostBatch([], [], [0], [], [], [PageBatch() for _ in range(self.num_page_groups)])
        whole: list[MultiModalSlice] = []
        for item in scheduled:
            try:  # no cost where nothing raises (Python 3.11's exception tables); inlined: a call per row costs
                seq, start, end = item.seq, item.seq.num_computed_tokens, item.context_len
                batch.input_ids += seq.token_ids[start:end]
                batch.positions += seq.positions(start, end) if seq.multimodal else range(start, end)
                batch.cu_seqlens_q.append(batch.cu_seqlens_q[-1] + item.num_new_tokens)
                batch.seq_lens.append(end)
                if seq.multimodal:
                    slices = slices_of(seq.multimodal, batch.cu_seqlens_q[-2], start, end)
                    batch.multimodal += slices
                    whole += slices if seq.whole_items else []
                for page, table in zip(batch.pages, seq.pages):
                    page.slot_mapping += [self.slot(table.blocks, p) for p in range(start, end)]
                    page.block_tables.append(table.blocks)
                    if table.shadows:
                        page.shadows = page.shadows or PageBatch()
                        page.shadows.block_tables.append(table.shadows)
                        page.shadows.slot_mapping += [self.slot(table.shadows, p) for p in range(start, end)]
                if self.has_state:
                    assert seq.state_slot is not None
                    batch.state_slots.append(seq.state_slot)
                if item.completes_prompt:
                    batch.sample_rows.append(batch.cu_seqlens_q[-1] - 1)
            except Exception as error:  # that request's failure, told to the engine
                raise RequestFailed(item.seq, error) from error
        if whole:  # each query sees up to itself, the tokens of such an item up to the item's end
            batch.key_limits = [p for item in scheduled for p in range(item.seq.num_computed_tokens, item.context_len)]
            for piece in whole:
                batch.key_limits[piece.row : piece.row + piece.last - piece.first] = [piece.range.end - 1] * (
                    piece.last - piece.first
                )
        return batch

    def to_device(self, batch: HostBatch) -> tuple[Tensor, Tensor, StepContext]:
        cu_seqlens_q = self._tensor(batch.cu_seqlens_q, torch.int32)
        seq_lens = self._tensor(batch.seq_lens, torch.int32)
        max_seqlen_q = max(b - a for a, b in zip(batch.cu_seqlens_q, batch.cu_seqlens_q[1:]))
        pages = []
        for page in batch.pages:
            width = max(len(row) for row in page.block_tables)
            meta = AttentionMetadata(
                cu_seqlens_q=cu_seqlens_q,
                seq_lens=seq_lens,
                block_tables=self._tensor([row + [0] * (width - len(row)) for row in page.block_tables], torch.int32),
                slot_mapping=self._tensor(page.slot_mapping, torch.int64),
                max_seqlen_q=max_seqlen_q,
                max_seq_len=max(batch.seq_lens),
            )
            if page.shadows is not None:
                assert len(page.shadows.block_tables) == len(page.block_tables), "every sequence has shadows, or none"
                meta.shadows = ops.ShadowPages(
                    self._tensor([row + [-1] * (width - len(row)) for row in page.shadows.block_tables], torch.int32),
                    self._tensor(page.shadows.slot_mapping, torch.int64),
                )
            pages.append(meta)
        pages = pages or [ops.without_kv(cu_seqlens_q, seq_lens, max_seqlen_q, max(batch.seq_lens))]
        if batch.key_limits:
            key_limits = self._tensor(batch.key_limits, torch.int32)
            for meta in pages:
                meta.key_limits = key_limits
        state_slots = self._tensor(batch.state_slots, torch.int32) if batch.state_slots else None
        multimodal = self._embeddings(batch.multimodal) if batch.multimodal else None
        step = StepContext(pages, state_slots, multimodal)
        return self._tensor(batch.input_ids, torch.int64), self._tensor(batch.positions, torch.int64), step

    def _embeddings(self, slices: list[MultiModalSlice]) -> MultiModalEmbeddings:
        encode = getattr(self.model, "encode", None)
        if encode is None:
            raise ValueError(f"{type(self.model).__name__} takes no images")
        return gather_embeddings(slices, encode, self.encoder_cache, self.device)

    def slot(self, table: list[int], position: int) -> int:
        """The cache slot (block * block_size + offset) of ``position`` in ``table``'s
        blocks; -1 where the table has no block there (a shadow trimmed, none kept)."""
        block = table[position // self.block_size]
        return block * self.block_size + position % self.block_size if block >= 0 else -1

    def _tensor(self, values: list, dtype: torch.dtype) -> Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

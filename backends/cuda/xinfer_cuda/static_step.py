"""A step padded to a fixed shape and run from static buffers, forward and sampling: what
a CUDA graph records.

A graph replays the kernels it recorded with their launch shapes and buffer
addresses, so every step is padded up to a captured shape (a :class:`Bucket`) and its
inputs are written into the same buffers. Padding tokens (id 0, position 0, slot -1:
no KV written) belong to no sequence; padding sequences have no query and no context,
and the attention kernels skip them; padding sample rows read row 0 and are greedy.

Nothing here needs a GPU: on the CPU, :meth:`StaticStep.run` is the captured code run
eagerly, which is how its equivalence with an unpadded step is tested.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from xinfer import ops
from xinfer.ops import (
    AttentionMetadata,
    DeviceTokens,
    HostBatch,
    PageBatch,
    ShadowPages,
    StepContext,
    StepForward,
    StepLimits,
    without_kv,
)
from xinfer.sampling import SampledRow, SamplingBatch

MIN_STEP_TOKENS = 64
# Steps with prompt tokens are compute-bound at a few hundred tokens, so padding costs
# its share of the step's time; more sizes cost capture time (about 0.3 s each).
SIZES_PER_OCTAVE = 4
DECODE_SIZES_PER_OCTAVE = 8


# Small decode batches get graphs of their own for contexts up to SHORT_CONTEXT tokens: their
# block tables are that narrow, so the decode kernel splits each context in few parts and
# merges them itself, without the reduce launch (kernels/attention.py, MERGE_SPLITS).
SHORT_CONTEXT = 1024
SHORT_CONTEXT_SEQS = 8


@dataclass(frozen=True)
class Bucket:
    """A captured step shape: ``num_seqs`` is also the number of logits rows."""

    num_tokens: int
    num_seqs: int
    decode: bool  # one token per sequence, each sampled: the split-K decode kernel
    max_blocks: int | None = None  # block table columns (None: every one, max_blocks_per_seq)


def decode_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, every 16 sequences up to 128, then DECODE_SIZES_PER_OCTAVE sizes
    between powers of two (a batch is padded by at most an eighth of its size; 36 graphs
    up to 1,024 sequences, where steps of 16 would take 68), and ``max_num_seqs``."""
    ladder, size = [1, 2, 4, 8], 16
    while size < max_num_seqs:
        ladder.append(size)
        size += 16 if size < 128 else (1 << (size.bit_length() - 1)) // DECODE_SIZES_PER_OCTAVE
    return sorted({s for s in ladder if s < max_num_seqs} | {max_num_seqs})


def token_sizes(max_num_tokens: int) -> list[int]:
    """From MIN_STEP_TOKENS up, SIZES_PER_OCTAVE sizes between powers of two (so a step
    is padded by at most 1 / SIZES_PER_OCTAVE of its size), and the largest step."""
    sizes, octave = set(), MIN_STEP_TOKENS
    while octave < max_num_tokens:
        sizes |= {octave + i * octave // SIZES_PER_OCTAVE for i in range(SIZES_PER_OCTAVE)}
        octave *= 2
    return sorted({s for s in sizes if s < max_num_tokens} | {max_num_tokens})


def step_buckets(limits: StepLimits) -> list[Bucket]:
    """Decode batches of a ladder of sizes, and steps with prompt tokens of a ladder of
    token counts (as many sequences as fit both the tokens and ``max_num_seqs``)."""
    decode = [Bucket(n, n, True) for n in decode_sizes(limits.max_num_seqs)]
    short_blocks = -(-limits.max_blocks_per_seq * SHORT_CONTEXT // limits.max_seq_len)
    if short_blocks < limits.max_blocks_per_seq:
        decode += [
            Bucket(b.num_tokens, b.num_seqs, True, short_blocks) for b in decode if b.num_seqs <= SHORT_CONTEXT_SEQS
        ]
    mixed = [Bucket(t, min(t, limits.max_num_seqs), False) for t in token_sizes(limits.max_num_tokens)]
    return decode + mixed


def pick_bucket(buckets: list[Bucket], batch: HostBatch) -> Bucket | None:
    """The smallest bucket of ``batch``'s kind that holds it (the narrowest block tables
    among those of its size), or None."""
    num_tokens, num_seqs = len(batch.input_ids), len(batch.seq_lens)
    width = batch.max_blocks
    fitting = [
        b for b in buckets
        if b.decode == batch.is_decode and b.num_tokens >= num_tokens and b.num_seqs >= num_seqs
        and (b.max_blocks is None or b.max_blocks >= width)
    ]  # fmt: skip
    return min(fitting, key=lambda b: (b.num_tokens, b.max_blocks or math.inf), default=None)


def pad_batch(batch: HostBatch, bucket: Bucket) -> HostBatch:
    """``batch`` grown to ``bucket``'s shape. Block tables stay one row per real
    sequence, as they are (padding sequences read none)."""
    pad_tokens = bucket.num_tokens - len(batch.input_ids)
    pad_seqs = bucket.num_seqs - len(batch.seq_lens)
    pages = [pad_page(page, pad_tokens) for page in batch.pages]
    return HostBatch(
        input_ids=batch.input_ids + [0] * pad_tokens,
        positions=batch.positions + [0] * pad_tokens,
        cu_seqlens_q=batch.cu_seqlens_q + batch.cu_seqlens_q[-1:] * pad_seqs,
        seq_lens=batch.seq_lens + [0] * pad_seqs,
        sample_rows=batch.sample_rows + [0] * (bucket.num_seqs - len(batch.sample_rows)),
        pages=pages,
        state_slots=batch.state_slots + [0] * pad_seqs if batch.state_slots else [],
    )


def pad_page(page: PageBatch, pad_tokens: int) -> PageBatch:
    """``page`` with ``pad_tokens`` more slots (-1: nothing written), its shadows' too."""
    return PageBatch(
        slot_mapping=page.slot_mapping + [-1] * pad_tokens,
        block_tables=page.block_tables,
        shadows=pad_page(page.shadows, pad_tokens) if page.shadows is not None else None,
    )


class ResidentRows:
    """Block-table rows kept on the device between steps, one slot per row list, so
    that a step sends only the entries its rows gained since they were last sent: a
    sequence's block lists only grow (a trim or a release replaces the list, which is
    then sent whole; :class:`xinfer.cache.block_pool.PageTable`). A slot's entries past
    its row are ``fill``; slot ``num_slots``, the padding sequences', is never written."""

    def __init__(self, num_slots: int, width: int, fill: int):
        self.width, self.fill = width, fill
        self.held: dict[int, tuple[list[int], int]] = {}  # id(row) -> (row, slot): the rows of the last step
        self.sent = [0] * num_slots  # entries of each slot's row on the device
        self.padding = num_slots

    def update(self, rows: list[list[int]], base: int, index: list[int], values: list[int]) -> list[int]:
        """The slot of each of ``rows``; appends to ``index`` (flat, from ``base``) and
        ``values`` the writes that bring the slots up to date. Slots of rows not in this
        step are given to the new ones."""
        held: dict[int, tuple[list[int], int]] = {}
        slots, new = [], []
        for i, row in enumerate(rows):
            entry = self.held.get(id(row))
            if entry is None or entry[0] is not row:
                new.append(i)
                slots.append(self.padding)
                continue
            slot, sent = entry[1], self.sent[entry[1]]
            if len(row) > sent:  # a block allocated since
                start = base + slot * self.width
                index += range(start + sent, start + len(row))
                values += row[sent:]
                self.sent[slot] = len(row)
            held[id(row)] = entry
            slots.append(slot)
        if new:
            used = {slot for _, slot in held.values()}
            free = [slot for slot in range(len(self.sent)) if slot not in used]
            for i in new:
                row, slot = rows[i], free.pop()
                length = max(len(row), self.sent[slot])  # over what the slot's last row left
                start = base + slot * self.width
                index += range(start, start + length)
                values += row + [self.fill] * (length - len(row))
                self.sent[slot] = len(row)
                held[id(row)] = (row, slot)
                slots[i] = slot
        self.held = held
        return slots


class StaticStep:
    """The buffers a step reads and the logits buffer it writes, sized for the largest
    bucket; each bucket reads a prefix of each.

    A step's inputs travel in two host-to-device copies (an int64 buffer: ids |
    positions | each page group's slots [and shadow slots] | sample rows | the sampled
    rows' parameters (a :class:`SamplingBatch`'s bytes), and an int32 one: cu_seqlens_q |
    seq_lens [| state slots] | per table (each group's block table [and shadow table]) the
    resident row of each sequence | the indexes, then the values, of the table entries
    sent this step (:class:`ResidentRows`)) and a scatter of those entries into the
    resident rows: few operations, since each costs a launch. The recorded step gathers
    its tables from the resident rows. The bracketed parts are there with a recent window
    (``limits.shadows``) and recurrent layers (``limits.state_slots``).
    """

    def __init__(self, forward: StepForward, limits: StepLimits, device: torch.device):
        self.forward = forward
        self.limits = limits
        self.max_tokens = tokens = max(limits.max_num_tokens, limits.max_num_seqs)
        seqs, groups, width = limits.max_num_seqs, limits.num_page_groups, limits.max_blocks_per_seq
        self.tables_per_group = 2 if limits.shadows else 1
        pin = device.type == "cuda"
        self.sampling_words = -(-SamplingBatch.nbytes(seqs) // 8)  # int64 words
        self.host64 = torch.zeros(
            (2 + groups * self.tables_per_group) * tokens + seqs + self.sampling_words,
            dtype=torch.int64,
            pin_memory=pin,
        )
        self.seq_fields = 3 if limits.state_slots else 2
        self.num_tables = num_tables = groups * self.tables_per_group
        # at most every entry of every table's rows is sent in one step: an index and a value each
        size32 = self.seq_fields * seqs + 1 + num_tables * seqs + 2 * num_tables * seqs * width
        self.host32 = torch.zeros(size32, dtype=torch.int32, pin_memory=pin)
        self.dev64 = torch.zeros_like(self.host64, device=device)
        self.dev32 = torch.zeros_like(self.host32, device=device)
        # per group: its block table's rows, then its shadow table's (-1: no shadow); a last row for padding
        fills = [-1 if i % 2 else 0 for i in range(num_tables)]
        self.resident = torch.tensor(fills, dtype=torch.int32).view(-1, 1, 1).repeat(1, seqs + 1, width).to(device)
        self.resident_rows = [ResidentRows(seqs, width, fill) for fill in fills]
        self._token_views(self.dev64)[2].fill_(-1)  # slots and shadow slots: nothing written before the first step
        self.host_sampling, self.sampling = self._sampling(self.host64), self._sampling(self.dev64)
        self.logits: Tensor | None = None  # [max_num_seqs, vocab], allocated by the first run
        # Marks the last copies out of the pinned host buffers. A step that samples
        # nothing returns without waiting for the device, so the next step must wait
        # for these copies before it rewrites the buffers.
        self.copied = torch.cuda.Event() if pin else None

    def fits(self, batch: HostBatch) -> bool:
        return batch.max_blocks <= self.limits.max_blocks_per_seq

    def load(
        self, batch: HostBatch, bucket: Bucket, pending: DeviceTokens | None = None, sampling: list[SampledRow] = ()
    ) -> None:
        """Write ``batch``, padded to ``bucket``, and its sampled rows into the device buffers."""
        assert all((p.shadows is not None) == self.limits.shadows for p in batch.pages), "shadows in every step or none"
        padded = pad_batch(batch, bucket)
        if self.copied is not None:
            self.copied.synchronize()
        ids, positions, rows = self._token_views(self.host64)[:2] + [self._rows(self.host64)]
        for host, values in [(ids, padded.input_ids), (positions, padded.positions), (rows, padded.sample_rows),
                             *zip(self._slot_views(self.host64), self._slot_fields(padded)),
                             *zip(self._seq_views(self.host32), self._seq_fields(padded))]:  # fmt: skip
            host[: len(values)] = torch.tensor(values, dtype=host.dtype)
        index: list[int] = []
        values: list[int] = []
        row_slots = self._row_slots(self.host32)
        table_size = (self.limits.max_num_seqs + 1) * self.limits.max_blocks_per_seq
        for k, (part, resident) in enumerate(zip(self._page_parts(padded), self.resident_rows)):
            slots = resident.update(part.block_tables, k * table_size, index, values)
            slots += [resident.padding] * (bucket.num_seqs - len(slots))
            row_slots[k, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
        sent = self._sent(self.host32, len(index))
        sent[:] = torch.tensor([index, values], dtype=torch.int32)
        self.host_sampling.write(list(sampling))
        self.dev64.copy_(self.host64, non_blocking=True)
        used32 = self.seq_fields * self.limits.max_num_seqs + 1 + self.num_tables * self.limits.max_num_seqs
        used32 += 2 * len(index)
        self.dev32[:used32].copy_(self.host32[:used32], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        if index:
            on_device = self._sent(self.dev32, len(index))
            self.resident.view(-1)[on_device[0]] = on_device[1]
        if pending is not None:
            pending.write_into(self._token_views(self.dev64)[0])

    def run(self, bucket: Bucket) -> Tensor:
        """Logits [num_seqs, vocab] of the bucket's sample rows, from the buffers (the
        code a graph records). Every bucket writes the same buffer, so the graphs hold
        one set of logits between them."""
        ids, positions = self._token_views(self.dev64)[:2]
        rows = self._rows(self.dev64)
        cu_seqlens_q, seq_lens, *state_slots = self._seq_views(self.dev32)
        slots = self._slot_views(self.dev64)
        t, s, k = bucket.num_tokens, bucket.num_seqs, self.tables_per_group
        width = bucket.max_blocks or self.limits.max_blocks_per_seq
        row_slots = self._row_slots(self.dev32)
        tables = [self.resident[i, :, :width].index_select(0, row_slots[i, :s]) for i in range(self.num_tables)]
        max_seqlen_q = 1 if bucket.decode else t  # > 1 adds the prefill kernel
        pages = []
        for group in range(self.limits.num_page_groups):
            meta = AttentionMetadata(
                cu_seqlens_q=cu_seqlens_q[: s + 1],
                seq_lens=seq_lens[:s],
                block_tables=tables[group * k],
                slot_mapping=slots[group * k][:t],
                max_seqlen_q=max_seqlen_q,
                max_seq_len=self.limits.max_seq_len,
                shadows=ShadowPages(tables[group * k + 1], slots[group * k + 1][:t]) if k == 2 else None,
            )
            pages.append(meta)
        pages = pages or [without_kv(cu_seqlens_q[: s + 1], seq_lens[:s], max_seqlen_q, self.limits.max_seq_len)]
        step = StepContext(pages, state_slots[0][:s] if state_slots else None)
        logits = self.forward(ids[:t], positions[:t], step, rows[:s])
        if self.logits is None:
            self.logits = logits.new_empty(self.limits.max_num_seqs, logits.shape[1])
        return self.logits[:s].copy_(logits)

    def sample(self, bucket: Bucket) -> Tensor:
        """Tokens [num_seqs] drawn from the logits :meth:`run` wrote."""
        assert self.logits is not None, "run the step first"
        return ops.sample(self.logits[: bucket.num_seqs], self.sampling)

    def _token_views(self, buf64: Tensor) -> list[Tensor]:
        """ids, positions, and every slot mapping as one view (for filling)."""
        tokens = self.max_tokens
        slots = buf64[2 * tokens : buf64.shape[0] - self.sampling_words - self.limits.max_num_seqs]
        return [buf64[:tokens], buf64[tokens : 2 * tokens], slots]

    def _rows(self, buf64: Tensor) -> Tensor:
        end = buf64.shape[0] - self.sampling_words
        return buf64[end - self.limits.max_num_seqs : end]

    def _sampling(self, buf64: Tensor) -> SamplingBatch:
        seqs = self.limits.max_num_seqs
        return SamplingBatch(
            buf64[buf64.shape[0] - self.sampling_words :].view(torch.uint8)[: SamplingBatch.nbytes(seqs)], seqs
        )

    def _slot_views(self, buf64: Tensor) -> list[Tensor]:
        """Per group: its slots, then its shadow slots."""
        return list(self._token_views(buf64)[2].split(self.max_tokens))

    def _slot_fields(self, batch: HostBatch) -> list[list[int]]:
        return [part.slot_mapping for part in self._page_parts(batch)]

    def _page_parts(self, batch: HostBatch) -> list[PageBatch]:
        """Per group: its pages, then its shadow pages."""
        parts = [(page, page.shadows) for page in batch.pages]
        return [part for pair in parts for part in pair[: self.tables_per_group] if part is not None]

    def _seq_views(self, buf32: Tensor) -> list[Tensor]:
        """cu_seqlens_q, seq_lens [, state slots]."""
        seqs = self.limits.max_num_seqs
        return [buf32[: seqs + 1], *buf32[seqs + 1 : self.seq_fields * seqs + 1].split(seqs)]

    def _seq_fields(self, batch: HostBatch) -> list[list[int]]:
        return [batch.cu_seqlens_q, batch.seq_lens] + ([batch.state_slots] if self.limits.state_slots else [])

    def _row_slots(self, buf32: Tensor) -> Tensor:
        """[table, sequence]: the resident row each sequence of the step reads."""
        start, seqs = self.seq_fields * self.limits.max_num_seqs + 1, self.limits.max_num_seqs
        return buf32[start : start + self.num_tables * seqs].view(self.num_tables, seqs)

    def _sent(self, buf32: Tensor, count: int) -> Tensor:
        """[2, count]: the flat indexes into the resident rows, then the values, of the entries sent."""
        start = (self.seq_fields + self.num_tables) * self.limits.max_num_seqs + 1
        return buf32[start : start + 2 * count].view(2, count)

"""A step padded to a fixed shape and run from static buffers: what a CUDA graph records.

A graph replays the kernels it recorded with their launch shapes and buffer
addresses, so every step is padded up to a captured shape (a :class:`Bucket`) and its
inputs are written into the same buffers. Padding tokens (id 0, position 0, slot -1:
no KV written) belong to no sequence; padding sequences have no query and no context,
and the attention kernels skip them; padding sample rows read row 0.

Nothing here needs a GPU: on the CPU, :meth:`StaticStep.run` is the captured code run
eagerly, which is how its equivalence with an unpadded step is tested.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from xinfer.ops import AttentionMetadata, DeviceTokens, HostBatch, StepForward, StepLimits

MIN_STEP_TOKENS = 64
# Steps with prompt tokens are compute-bound at a few hundred tokens, so padding costs
# its share of the step's time; more sizes cost capture time (about 0.3 s each).
SIZES_PER_OCTAVE = 4


@dataclass(frozen=True)
class Bucket:
    """A captured step shape: ``num_seqs`` is also the number of logits rows."""

    num_tokens: int
    num_seqs: int
    decode: bool  # one token per sequence, each sampled: the split-K decode kernel


def decode_sizes(max_num_seqs: int) -> list[int]:
    ladder = [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 16))
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
    mixed = [Bucket(t, min(t, limits.max_num_seqs), False) for t in token_sizes(limits.max_num_tokens)]
    return decode + mixed


def pick_bucket(buckets: list[Bucket], batch: HostBatch) -> Bucket | None:
    """The smallest bucket of ``batch``'s kind that holds it, or None."""
    num_tokens, num_seqs = len(batch.input_ids), len(batch.seq_lens)
    fitting = [
        b for b in buckets
        if b.decode == batch.is_decode and b.num_tokens >= num_tokens and b.num_seqs >= num_seqs
    ]  # fmt: skip
    return min(fitting, key=lambda b: b.num_tokens, default=None)


def pad_batch(batch: HostBatch, bucket: Bucket) -> HostBatch:
    """``batch`` grown to ``bucket``'s shape. Block tables stay one row per real
    sequence, padded to one width (padding sequences read none)."""
    pad_tokens = bucket.num_tokens - len(batch.input_ids)
    pad_seqs = bucket.num_seqs - len(batch.seq_lens)
    width = max(len(row) for row in batch.block_tables)
    return HostBatch(
        input_ids=batch.input_ids + [0] * pad_tokens,
        positions=batch.positions + [0] * pad_tokens,
        slot_mapping=batch.slot_mapping + [-1] * pad_tokens,
        cu_seqlens_q=batch.cu_seqlens_q + batch.cu_seqlens_q[-1:] * pad_seqs,
        seq_lens=batch.seq_lens + [0] * pad_seqs,
        block_tables=[row + [0] * (width - len(row)) for row in batch.block_tables],
        sample_rows=batch.sample_rows + [0] * (bucket.num_seqs - len(batch.sample_rows)),
        shadow_tables=[row + [-1] * (width - len(row)) for row in batch.shadow_tables],
        shadow_slot_mapping=batch.shadow_slot_mapping + [-1] * (bucket.num_tokens - len(batch.shadow_slot_mapping))
        if batch.shadow_tables
        else [],
    )


class StaticStep:
    """The buffers a step reads and the logits buffer it writes, sized for the largest
    bucket; each bucket reads a prefix of each.

    A step's inputs travel in two host-to-device copies (an int64 buffer: ids |
    positions | slots | sample rows [| shadow slots], and an int32 one: cu_seqlens_q |
    seq_lens | table rows packed at the step's width [| shadow table rows likewise])
    and a scatter of the table rows: few operations, since each costs a launch. The
    bracketed parts are there with a recent window (``limits.shadows``).
    """

    def __init__(self, forward: StepForward, limits: StepLimits, device: torch.device):
        self.forward = forward
        self.limits = limits
        self.max_tokens = tokens = max(limits.max_num_tokens, limits.max_num_seqs)
        seqs = limits.max_num_seqs
        pin = device.type == "cuda"
        tables = 2 if limits.shadows else 1
        self.host64 = torch.zeros((3 + limits.shadows) * tokens + seqs, dtype=torch.int64, pin_memory=pin)
        self.host32 = torch.zeros(2 * seqs + 1 + tables * seqs * limits.max_blocks_per_seq, dtype=torch.int32, pin_memory=pin)
        self.dev64 = torch.zeros_like(self.host64, device=device)
        self.dev32 = torch.zeros_like(self.host32, device=device)
        self.block_tables = torch.zeros(seqs, limits.max_blocks_per_seq, dtype=torch.int32, device=device)
        self.shadow_tables = torch.full_like(self.block_tables, -1) if limits.shadows else None
        views = self._views(self.dev64, self.dev32)
        for slots in (views[2], *views[6:]):  # slots and shadow slots: nothing written before the first step
            slots.fill_(-1)
        self.logits: Tensor | None = None  # [max_num_seqs, vocab], allocated by the first run
        # Marks the last copies out of the pinned host buffers. A step that samples
        # nothing returns without waiting for the device, so the next step must wait
        # for these copies before it rewrites the buffers.
        self.copied = torch.cuda.Event() if device.type == "cuda" else None

    def fits(self, batch: HostBatch) -> bool:
        return max(len(row) for row in batch.block_tables) <= self.limits.max_blocks_per_seq

    def load(self, batch: HostBatch, bucket: Bucket, pending: DeviceTokens | None = None) -> None:
        """Write ``batch``, padded to ``bucket``, into the device buffers."""
        assert bool(batch.shadow_tables) == self.limits.shadows, "a recent window: every step has shadows, or none"
        padded = pad_batch(batch, bucket)
        if self.copied is not None:
            self.copied.synchronize()
        for host, values in zip(self._views(self.host64, self.host32), self._fields(padded)):
            host[: len(values)] = torch.tensor(values, dtype=host.dtype)
        n, width = len(batch.seq_lens), len(padded.block_tables[0])
        rows = [padded.block_tables] + ([padded.shadow_tables] if self.shadow_tables is not None else [])
        packed = self._tables(self.host32)[: len(rows) * n * width]
        packed[:] = torch.tensor(rows, dtype=torch.int32).flatten()
        self.dev64.copy_(self.host64, non_blocking=True)
        used32 = 2 * self.limits.max_num_seqs + 1 + len(rows) * n * width
        self.dev32[:used32].copy_(self.host32[:used32], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        on_device = self._tables(self.dev32)[: len(rows) * n * width].view(len(rows), n, width)
        self.block_tables[:n, :width] = on_device[0]
        if self.shadow_tables is not None:
            self.shadow_tables[:n, :width] = on_device[1]
        if pending is not None:
            pending.write_into(self._views(self.dev64, self.dev32)[0])

    def run(self, bucket: Bucket) -> Tensor:
        """Logits [num_seqs, vocab] of the bucket's sample rows, from the buffers (the
        code a graph records). Every bucket writes the same buffer, so the graphs hold
        one set of logits between them."""
        ids, positions, slots, rows, cu_seqlens_q, seq_lens, *shadow_slots = self._views(self.dev64, self.dev32)
        t, s = bucket.num_tokens, bucket.num_seqs
        meta = AttentionMetadata(
            cu_seqlens_q=cu_seqlens_q[: s + 1],
            seq_lens=seq_lens[:s],
            block_tables=self.block_tables[:s],
            slot_mapping=slots[:t],
            max_seqlen_q=1 if bucket.decode else t,  # > 1 adds the prefill kernel
            max_seq_len=self.limits.max_seq_len,
        )
        if self.shadow_tables is not None:
            meta.shadow_tables, meta.shadow_slot_mapping = self.shadow_tables[:s], shadow_slots[0][:t]
        logits = self.forward(ids[:t], positions[:t], meta, rows[:s])
        if self.logits is None:
            self.logits = logits.new_empty(self.limits.max_num_seqs, logits.shape[1])
        return self.logits[:s].copy_(logits)

    def _views(self, buf64: Tensor, buf32: Tensor) -> list[Tensor]:
        """ids, positions, slots, sample rows, cu_seqlens_q, seq_lens [, shadow slots]."""
        tokens, seqs = self.max_tokens, self.limits.max_num_seqs
        ids, positions, slots, rows, *shadow_slots = buf64.split([tokens] * 3 + [seqs] + [tokens] * self.limits.shadows)
        cu_seqlens_q, seq_lens = buf32[: seqs + 1], buf32[seqs + 1 : 2 * seqs + 1]
        return [ids, positions, slots, rows, cu_seqlens_q, seq_lens, *shadow_slots]

    def _fields(self, batch: HostBatch) -> list[list[int]]:
        shadow_slots = [batch.shadow_slot_mapping] if self.limits.shadows else []
        return [batch.input_ids, batch.positions, batch.slot_mapping, batch.sample_rows,
                batch.cu_seqlens_q, batch.seq_lens, *shadow_slots]  # fmt: skip

    def _tables(self, buf32: Tensor) -> Tensor:
        return buf32[2 * self.limits.max_num_seqs + 1 :]

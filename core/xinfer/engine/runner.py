"""One engine step on the device: flatten the scheduled sequences into a batch,
run the model, and sample the sequences that completed their prompt."""

from __future__ import annotations

import torch
from torch import Tensor

from xinfer.engine.sampler import Sampler, SamplerOutput
from xinfer.engine.scheduler import ScheduledSeq
from xinfer.engine.sequence import Sequence
from xinfer.forward_context import forward_context
from xinfer.model import CausalLM
from xinfer import ops
from xinfer.ops import AttentionMetadata, DecodeRunner


class ModelRunner:
    def __init__(self, model: CausalLM, block_size: int, device: torch.device, seed: int = 0):
        self.model = model
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(device, seed)
        self.decode_graphs: DecodeRunner | None = None

    @torch.inference_mode()
    def capture_decode(self, max_num_seqs: int, max_model_len: int) -> None:
        """Let the backend capture decode steps (CUDA graphs) if it can."""
        capture = getattr(ops.current(), "capture_decode", None)
        if capture is not None:
            max_blocks = -(-max_model_len // self.block_size)
            self.decode_graphs = capture(self.decode_logits, max_num_seqs, max_blocks, max_model_len, self.device)

    def decode_logits(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        with forward_context(meta):
            return self.model.compute_logits(self.model(input_ids, positions))

    @torch.inference_mode()
    def step(self, batch: list[ScheduledSeq]) -> tuple[list[Sequence], SamplerOutput | None]:
        """Runs ``batch``; returns the sequences that sampled a token, and their tokens."""
        input_ids, positions, meta, sample_rows = self.prepare(batch)
        sampling = [s.seq for s in batch if s.completes_prompt]
        logits = None
        if self.decode_graphs is not None and len(sampling) == len(input_ids):
            logits = self.decode_graphs(input_ids, positions, meta)
        if logits is None:
            with forward_context(meta):
                hidden = self.model(input_ids, positions)
            if not sampling:
                return [], None
            logits = self.model.compute_logits(hidden[sample_rows])
        return sampling, self.sampler(logits, sampling)

    def prepare(self, batch: list[ScheduledSeq]) -> tuple[Tensor, Tensor, AttentionMetadata, Tensor]:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_seqlens = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += [self._slot(seq, p) for p in range(start, end)]
            cu_seqlens.append(cu_seqlens[-1] + item.num_new_tokens)
            seq_lens.append(end)
            if item.completes_prompt:
                sample_rows.append(cu_seqlens[-1] - 1)
        width = max(len(s.seq.block_table) for s in batch)
        tables = [s.seq.block_table + [0] * (width - len(s.seq.block_table)) for s in batch]
        meta = AttentionMetadata(
            cu_seqlens_q=self._tensor(cu_seqlens, torch.int32),
            seq_lens=self._tensor(seq_lens, torch.int32),
            block_tables=self._tensor(tables, torch.int32),
            slot_mapping=self._tensor(slots, torch.int64),
            max_seqlen_q=max(s.num_new_tokens for s in batch),
            max_seq_len=max(seq_lens),
        )
        return (
            self._tensor(input_ids, torch.int64),
            self._tensor(positions, torch.int64),
            meta,
            self._tensor(sample_rows, torch.int64),
        )

    def _slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def _tensor(self, values: list, dtype: torch.dtype) -> Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

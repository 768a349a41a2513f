"""flash-linear-attention's chunked gated delta rule (``fla-core``, xinfer-qwen's ``fla`` extra)
as the prefill of :func:`xinfer_qwen.kernels.delta_rule.delta_rule`, where it imports.

Why: on the H200, at Qwen3.6-35B-A3B's shapes, fla 0.6.0's ``chunk_gated_delta_rule`` takes
1.58 ms for 8 prompts of 2,048 tokens where our chunk kernel takes 3.06 ms (benchmarks/RESULTS.md,
fourth session): it solves every chunk's triangular system in parallel and leaves only the
state's update to the sequential walk, where ours walks each sequence's chunks with all of a
chunk's products. Our kernel stays: it is the CPU/interpreter path the tests check, the path
without fla, and the faster one for steps of many short sequences (below).

The adaptation to our cache:

- fla takes the sequences' initial states as one dense [N, Hv, Dk, Dv] fp32 tensor and returns
  the final states as another, so each call copies the slots of the sequences that continue
  into the initial states (zeros for those that start) and the final states back to the slots
  of the sequences with rows in the step (a padding sequence's slot, slot 0, may be a real
  sequence's too, so it is skipped). fla itself reads, zeroes and writes one state per sequence,
  padding included: 2 MiB each at 32 heads of 128 x 128. Against our kernel, which reads and
  writes each real sequence's state once and skips padding, that is about 10 MiB more per real
  sequence and 6 MiB per padding one (a CUDA-graph bucket of a few prompt tokens is padded to
  ``max_num_seqs`` sequences), 1.5 to 2.5 us at the H200's bandwidth, where fla saves about
  0.09 us per token and layer (1.5 ms over 16k tokens). Hence :func:`wins`: fla only where a
  step has at least a chunk's rows per sequence (the break-even is near 28).
- fla computes its varlen chunk indices on the host from ``cu_seqlens`` (a sync, and under a
  CUDA graph indices frozen at capture). :func:`chunk_indices` builds them on the device for a
  count fixed by the step's shape (T / 64 + N, at least the real number), the spare ones
  naming an extra sequence of zero rows, which fla's kernels skip (their loads and stores are
  bounded by the sequence's length). So the call can be captured and replayed with other
  lengths.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from xinfer.kernel_api import launch_chain
from xinfer.ops import AttentionMetadata

log = logging.getLogger("xinfer")

CHUNK = 64  # fla's chunk (its default; the indices below are built for it)
COPY_BLOCK = 4096

UNRESOLVED = object()
chunk_rule: Any = UNRESOLVED  # fla's function once imported, None without it (the tests put a reference here)


def available() -> bool:
    """Whether fla's ``chunk_gated_delta_rule`` imports (tried once, on the first step that asks:
    importing fla takes seconds and its own checks of the device)."""
    global chunk_rule
    if chunk_rule is UNRESOLVED:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule

            chunk_rule = chunk_gated_delta_rule
        except ImportError:  # the fla extra is not installed
            chunk_rule = None
        except Exception as error:  # noqa: BLE001 - an fla that fails with this torch/Triton: ours, said once
            log.warning("fla-core does not import (%s: %s): the Gated DeltaNet prefill stays ours", type(error).__name__,
                        error)  # fmt: skip
            chunk_rule = None
    return chunk_rule is not None


def wins(device: torch.device, dtype: torch.dtype, tokens: int, num_seqs: int, max_seqlen_q: int) -> bool:
    """Whether a step of ``tokens`` rows over ``num_seqs`` sequences (padding included) goes to
    fla: on a GPU (fla's kernels need one), in 16 bits (fp32 steps keep our kernel's exact fp32
    products; fla's run in tf32), a step with prompt rows and at least a chunk's rows per
    sequence (see the top)."""
    return (
        available() and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and max_seqlen_q > 1
        and tokens >= CHUNK * num_seqs
    )  # fmt: skip


def chunk_indices(cu_seqlens: Tensor, tokens: int) -> tuple[Tensor, Tensor]:
    """``cu_seqlens`` (int64) with an extra zero-row sequence after the N real ones, and fla's
    varlen chunk indices [tokens / CHUNK + N, 2]: (sequence, chunk in it) of every sequence's
    chunks in order, then (N, 0) for the spare rows. Device ops only, no host sync."""
    cu = cu_seqlens.long()
    num_seqs = cu.numel() - 1
    chunks = (cu[1:] - cu[:-1] + CHUNK - 1) // CHUNK
    ends = torch.cumsum(chunks, 0)  # one past each sequence's last chunk
    index = torch.arange(triton.cdiv(tokens, CHUNK) + num_seqs, device=cu.device)
    seq = torch.searchsorted(ends, index, right=True)  # num_seqs past the last chunk: the extra sequence
    starts = torch.cat([ends - chunks, ends.new_zeros(1)])
    spare = seq == num_seqs
    within = torch.where(spare, 0, index - starts[seq])
    return torch.cat([cu, cu[-1:]]), torch.stack([seq, within], 1)


@triton.jit
def _gather_kernel(state_ptr, initial_ptr, cu_seqlens_ptr, seq_lens_ptr, slots_ptr, stride_state_slot, numel,
                   BLOCK: tl.constexpr, ENTER: tl.constexpr):  # fmt: skip
    """``initial[n] = state[slots[n]]`` (a block of it) for a sequence ``n`` that continues, zeros
    for one that starts; nothing for a sequence of no rows (fla only carries its state through)."""
    ENTER()
    seq = tl.program_id(0)
    lo = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - lo
    if q_len == 0:
        return
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    continues = tl.load(seq_lens_ptr + seq) != q_len
    slot_ptr = state_ptr + tl.load(slots_ptr + seq).to(tl.int64) * stride_state_slot
    values = tl.load(slot_ptr + offsets, mask=(offsets < tl.where(continues, numel, 0)), other=0.0)  # a new slot: NaN
    tl.store(initial_ptr + seq.to(tl.int64) * numel + offsets, values.to(tl.float32), mask=offsets < numel)


@triton.jit
def _write_back_kernel(final_ptr, state_ptr, cu_seqlens_ptr, slots_ptr, stride_state_slot, numel,
                       BLOCK: tl.constexpr, ENTER: tl.constexpr):  # fmt: skip
    """``state[slots[n]] = final[n]`` (a block of it) for a sequence ``n`` with rows in the step."""
    ENTER()
    seq = tl.program_id(0)
    if tl.load(cu_seqlens_ptr + seq + 1) == tl.load(cu_seqlens_ptr + seq):
        return
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    values = tl.load(final_ptr + seq.to(tl.int64) * numel + offsets, mask=offsets < numel)
    slot_ptr = state_ptr + tl.load(slots_ptr + seq).to(tl.int64) * stride_state_slot
    tl.store(slot_ptr + offsets, values.to(state_ptr.dtype.element_ty), mask=offsets < numel)


def delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
    meta: AttentionMetadata,
    slots: Tensor,
) -> Tensor:
    """:func:`xinfer_qwen.deltanet_ops.delta_rule` by fla's ``chunk_gated_delta_rule``;
    rows of no sequence (a padded step's) are left unwritten (undefined)."""
    assert available(), "fla_prefill.delta_rule: fla is not installed"
    per_slot = state[0].numel()
    assert state[0].is_contiguous() and state.stride(0) >= per_slot, (
        "fla_prefill.delta_rule: each slot's state is one block"
    )
    tokens, num_seqs = v.shape[0], meta.num_seqs
    cu_seqlens, indices = chunk_indices(meta.cu_seqlens_q, tokens)
    grid = (num_seqs, triton.cdiv(per_slot, COPY_BLOCK))
    copy = dict(BLOCK=COPY_BLOCK, num_warps=4, **launch_chain(state.device))
    # the rows of sequences of no rows (padding, and the spare chunks' extra one) stay undefined: fla only
    # carries them to its final states, which are not written back
    initial = torch.empty((num_seqs + 1, *state.shape[1:]), dtype=torch.float32, device=state.device)
    _gather_kernel[grid](state, initial, meta.cu_seqlens_q, meta.seq_lens, slots, state.stride(0), per_slot, **copy)
    out, final = chunk_rule(
        q=q[None], k=k[None], v=v[None], g=g.float()[None], beta=beta[None], scale=k.shape[-1] ** -0.5,
        initial_state=initial, output_final_state=True, cu_seqlens=cu_seqlens, chunk_indices=indices,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    _write_back_kernel[grid](final.contiguous(), state, meta.cu_seqlens_q, slots, state.stride(0), per_slot, **copy)
    return out[0]

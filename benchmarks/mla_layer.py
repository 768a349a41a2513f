"""The latent attention of one batch-1 decode layer at Moonlight-16B-A3B's shapes (benchmarks/mla.py), from the
projections' outputs to o_proj's input, the path before issue #33's fusions beside the one now taken; one JSON
line per (op, context, path).

    python benchmarks/mla_layer.py [--contexts 128 384 4096] [--max-context 8192] [--no-pdl]
    python benchmarks/mla_layer.py --smoke   # tiny shapes on the CPU under the Triton interpreter

Ops and paths (16 heads of 128 + 64 query/key dims and 128 value dims, a 512-value latent, bf16 cache of
16-token blocks):

- ``rows``: the absorbed queries, rotated rope parts and the step's cache row from q [1, 16, 192] (a view of
  the query projection) and kv [1, 576]. Before: ``q_rope.contiguous()``, the rotary, the latent's
  ``rms_norm``, ``torch.cat``, a ``bmm`` with ``w_uk`` (five launches; the row stored by the attention).
  Now: ``mla_rows``, storing the row (one launch).
- ``attention``: decode over ``--contexts`` rows, in a grid sized for ``--max-context`` (as a CUDA graph
  captured for the engine's longest context is). Before: ``mla_attention`` storing the row, decode, reduce,
  then a ``bmm`` with ``w_uv`` (four launches). Now: ``mla_attention`` of the stored row with ``w_uv``:
  decode and the reduce up-projecting (two launches).
- ``block``: both, as a layer runs them.
- ``block+projections``: the block between the layer's projections, as a batch-1 step runs it: the input
  norm in the GEMV of ``q_proj`` and ``kv_a_proj_with_mqa`` merged (``qkv_a_proj``), the block, ``o_proj``
  (the backend's small-batch linears, each measured per shape as the engine does).

The before path runs today's decode and reduce kernels: the reduce reads only the splits a context reaches
(before this change it read all 32, empty ones too: 6.6 us a call in the brief's profile of a whole step).

Method (benchmarks/decode_layer.py's): 27 layers' inputs (a cache and weights per layer), a CUDA graph of a
call per layer, replayed between ``torch.cuda.Event`` records, the best replay divided by the calls.
``bytes`` are what a call must move; each pair of paths is checked to agree before it is timed.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from decode_layer import Setup, agree, per_call_us, rand, report

MOONLIGHT = dict(hidden=2048, heads=16, nope=128, rope=64, v_dim=128, rank=512, block_size=16)
SMOKE = dict(hidden=64, heads=4, nope=16, rope=8, v_dim=16, rank=32, block_size=16)
LAYERS = 27
EPS = 1e-6


@dataclass
class Layer:
    cache: torch.Tensor  # [blocks, block_size, R + P]
    norm_weight: torch.Tensor
    w_uk: torch.Tensor  # [H, N, R]
    w_uv: torch.Tensor  # [H, V, R]
    input_norm: torch.Tensor  # [hidden]
    qkv_a_proj: torch.Tensor  # [H * (N + P) + R + P, hidden]: q_proj's rows, then kv_a_proj_with_mqa's
    o_proj: torch.Tensor  # [hidden, H * V]


def mla_case(setup: Setup, context: int, max_context: int) -> None:
    from xinfer import ops
    from xinfer.ops import AttentionMetadata, Rotation
    from xinfer_cuda.kernels import norm, rotary
    from xinfer_deepseek.kernels import mla, mla_rows
    from xinfer_deepseek.mla_ops import expand

    s = setup.shape
    heads, nope, rope, rank, block_size = s["heads"], s["nope"], s["rope"], s["rank"], s["block_size"]
    blocks = math.ceil(context / block_size)
    table = torch.zeros(1, math.ceil(max_context / block_size), dtype=torch.int32, device=setup.device)
    table[0, :blocks] = torch.randperm(blocks, device=setup.device, dtype=torch.int32)
    slot = table[0, (context - 1) // block_size].long() * block_size + (context - 1) % block_size
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32, device=setup.device),
        seq_lens=torch.tensor([context], dtype=torch.int32, device=setup.device),
        block_tables=table,
        slot_mapping=slot.view(1),
        max_seqlen_q=1,
        max_seq_len=context,
    )
    hidden, v_dim = s["hidden"], s["v_dim"]
    layers = [
        Layer(rand(setup, blocks, block_size, rank + rope), 1 + rand(setup, rank, scale=0.1),
              rand(setup, heads, nope, rank, scale=0.05), rand(setup, heads, v_dim, rank, scale=0.05),
              1 + rand(setup, hidden, scale=0.1), rand(setup, heads * (nope + rope) + rank + rope, hidden, scale=0.02),
              rand(setup, hidden, heads * v_dim, scale=0.02))
        for _ in range(setup.copies)
    ]  # fmt: skip
    h, residual = rand(setup, 1, hidden), rand(setup, 1, hidden)
    q = rand(setup, 1, heads * (nope + rope)).view(1, heads, nope + rope)
    kv = rand(setup, 1, rank + rope)
    positions = torch.tensor([context - 1], device=setup.device)
    angles = torch.outer(torch.arange(max_context, device=setup.device).float(), torch.rand(rope // 2).to(setup.device))
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
    scale = (nope + rope) ** -0.5

    def rows_before(layer: Layer, q: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q_nope, q_rope = q.split([nope, rope], dim=-1)
        latent, k_rope = kv.split([rank, rope], dim=-1)
        q_rope, k_rope = rotary.rotary(q_rope.contiguous(), k_rope.unsqueeze(1).contiguous(), positions, cos_sin)
        normed = norm.rms_norm(latent.contiguous(), layer.norm_weight, EPS)
        assert isinstance(normed, torch.Tensor)
        row = torch.cat((normed, k_rope.squeeze(1)), dim=-1)
        return torch.bmm(q_nope.transpose(0, 1), layer.w_uk).transpose(0, 1), q_rope, row

    def rows_now(layer: Layer, q: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rotation = Rotation(positions, cos_sin)
        return mla_rows.mla_rows(q, kv, rotation, layer.norm_weight, EPS, layer.w_uk, layer.cache, meta.slot_mapping)

    def attention_before(layer: Layer, q_latent: torch.Tensor, q_rope: torch.Tensor, row: torch.Tensor):
        return expand(mla.mla_attention(q_latent, q_rope, row, layer.cache, meta, scale), layer.w_uv)

    def attention_now(layer: Layer, q_latent: torch.Tensor, q_rope: torch.Tensor, row: torch.Tensor):
        return mla.mla_attention(q_latent, q_rope, None, layer.cache, meta, scale, layer.w_uv)

    def with_projections(block: Callable[[Layer, torch.Tensor, torch.Tensor], torch.Tensor], layer: Layer):
        projected, _, _ = ops.norm_linear(h, residual, layer.input_norm, EPS, layer.qkv_a_proj)
        q_flat, kv_a = projected.split([heads * (nope + rope), rank + rope], dim=-1)
        return ops.linear(block(layer, q_flat.view(1, heads, nope + rope), kv_a), layer.o_proj)

    def block_before(layer: Layer, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return attention_before(layer, *rows_before(layer, q, kv))

    def block_now(layer: Layer, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return attention_now(layer, *rows_now(layer, q, kv))

    first = layers[0]
    agree(with_projections(block_now, first), with_projections(block_before, first), "block+projections")
    before, now = rows_before(first, q, kv), rows_now(first, q, kv)
    for name, old, new in zip(("q_latent", "q_rope", "row"), before, now):
        agree(new, old, f"rows: {name}")
    agree(first.cache.view(-1, rank + rope)[slot], before[2][0], "rows: the stored row")
    agree(attention_now(first, *now), attention_before(first, *before), "attention")

    element = q.element_size()
    weight_bytes = heads * nope * rank * element
    row_bytes = (rank + rope) * element
    rows_nbytes = (q.numel() + kv.numel() + rank + heads * (rank + rope) + 2 * (rank + rope)) * element + weight_bytes
    attention_nbytes = context * row_bytes + heads * (rank + rope + s["v_dim"]) * element + weight_bytes
    inputs = now  # (the attention's: any layer's do)
    projection_nbytes = sum(w.numel() for w in (first.qkv_a_proj, first.o_proj)) * element
    paths = {
        "rows": ((rows_before, "q_rope.contiguous, rotary, rms_norm, cat, bmm"), (rows_now, "mla_rows"),
                 rows_nbytes, lambda fn, layer: fn(layer, q, kv)),
        "attention": ((attention_before, "mla_attention (store, decode, reduce), bmm"),
                      (attention_now, "mla_attention (decode, reduce with w_uv)"), attention_nbytes,
                      lambda fn, layer: fn(layer, *inputs)),
        "block": ((block_before, "before"), (block_now, "now"), rows_nbytes + attention_nbytes,
                  lambda fn, layer: fn(layer, q, kv)),
        "block+projections": ((block_before, "before"), (block_now, "now"),
                              rows_nbytes + attention_nbytes + projection_nbytes, with_projections),
    }  # fmt: skip
    for op, (old_path, new_path, nbytes, call) in paths.items():
        for fn, path in (old_path, new_path):
            calls = [lambda layer=layer, fn=fn, call=call: call(fn, layer) for layer in layers]
            report(op, path, per_call_us(calls, setup), nbytes, context=context, max_context=max_context)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 384, 4096])
    parser.add_argument("--max-context", type=int, default=8192, help="the context the graph's grid is sized for")
    parser.add_argument("--no-pdl", action="store_true", help="launch without programmatic dependent launch")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU, Triton interpreter (times meaningless)")
    args = parser.parse_args()
    if args.smoke and os.environ.get("TRITON_INTERPRET") != "1":  # the interpreter is chosen when triton is imported
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "TRITON_INTERPRET": "1"})
    from xinfer import ops
    from xinfer_cuda.kernels import launch
    from xinfer_cuda.ops import CudaOps

    if args.no_pdl:
        launch.pdl = lambda device: {"PDL": False, "launch_pdl": False}
    if args.smoke:
        setup = Setup(SMOKE, torch.device("cpu"), torch.float32, True, 2)
        contexts, max_context = [20, 70], 256
    else:
        setup = Setup(MOONLIGHT, torch.device("cuda"), torch.bfloat16, False, LAYERS)
        contexts, max_context = args.contexts, args.max_context
    torch.manual_seed(0)
    with ops.use(CudaOps()):
        for context in contexts:
            mla_case(setup, context, max_context)


if __name__ == "__main__":
    main()

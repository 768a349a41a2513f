"""Compile every kernel launch of the CUDA backend for GPU targets, on a machine without a GPU.

The interpreter runs the kernels' logic but accepts code the GPU compiler rejects; this
lowers each launch the wrappers make (Llama-like shapes, several head dims, window and
softcap) through Triton's real pipeline to a cubin for each target. Usage:

    python tests/backends/compile_check.py [--dtype bfloat16] 90 80

Prints one line per kernel variant (registers and spills when cuobjdump is there) and
exits non-zero if any variant fails to compile. Must run without TRITON_INTERPRET.
Registers differ between Triton releases; for those of the GPU machine's, put that
release first on the path (``pip install --target /tmp/triton36 triton==3.6.0``, then
``PYTHONPATH=/tmp/triton36:...``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import replace

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from xinfer import ops
from xinfer.kv import get_format
from xinfer.layers.moe import Routing
from xinfer.ops import AttentionMetadata, HeadNorms, Rotation, ShadowPages
from xinfer.sampling import SampledRow, SamplingBatch, SamplingParams
from xinfer_cuda.fp8_tensor_cores import GEMV_WARPS
from xinfer_cuda.kernels import (
    activation,
    attention,
    encoder_attention,
    fp8_gemv,
    gemv,
    kv_codes,
    kv_quant_write,
    kv_write,
    launch,
    moe,
    moe_routing,
    norm,
    norm_linear,
    plane_i8_dot,
    plane_i8_gemv,
    plane_linear,
    quant_linear,
    quant_moe,
    rotary,
    sampling,
    splits,
    token_bitmask,
)
from xinfer_cuda.kernels.gguf_blocks import FORMATS
from xinfer_cuda.kernels.gguf_planes import LAYOUTS
from xinfer_cuda.linear import DOT_TILES, ONE_PASS_TILES, ONE_ROW_TILES
from xinfer_cuda.ops import CudaOps
from xinfer_cuda.quant_weights import candidates, plane_candidates
from xinfer_deepseek.kernels import indexer, mla, mla_rows, sparse_mla
from xinfer_qwen.kernels import conv1d, delta_rule, fla_prefill, gated_norm

MODULES = (
    activation,
    attention,
    encoder_attention,
    gemv,
    kv_quant_write,
    kv_write,
    moe,
    moe_routing,
    norm,
    norm_linear,
    rotary,
    sampling,
)
MODULES += (fp8_gemv, plane_i8_dot, plane_i8_gemv, plane_linear, quant_linear, quant_moe, splits, token_bitmask)
# the plugins' kernels: qwen's Gated DeltaNet (and its prefill form), deepseek's latent attention, sparse (V3.2)
# too, and its indexer
MODULES += (conv1d, delta_rule, fla_prefill, gated_norm, mla, mla_rows, sparse_mla, indexer)
# GGUF formats whose linear compiles every tile the measurement tries (one of 32-value blocks, one K-quant)
MEASURED_FORMATS = ("Q8_0", "Q4_K")
QUANTIZED = ("fp8", "turbo8", "turbo4", "turbo3", "turbo4-lm", "turbo3-lm")
# a format of each key code with a recent window: float (fp8), uniform (4 bits), Lloyd-Max (3 bits)
WINDOW_FORMATS = ("fp8", "turbo4", "turbo3-lm")
POINTER_TYPES = {
    torch.int8: "*i8",
    torch.uint8: "*u8",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.float32: "*fp32",
    torch.int32: "*i32",
    torch.int64: "*i64",
    torch.int16: "*i16",
    torch.uint16: "*u16",
}


LAUNCHES: list = []
# kernels written so that their tensors need no layout conversion: each barrier past these (the output's store)
# is a conversion through shared memory that a Triton release chose (fp8_gemv.py)
BARRIERS = {"_fp8_gemv_kernel": 1}


class _Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` records the launch."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return lambda *args, **kwargs: LAUNCHES.append((self.fn, args, kwargs))


for _module in MODULES:
    for _name, _obj in list(vars(_module).items()):
        if isinstance(_obj, triton.runtime.jit.JITFunction) and _name.endswith("_kernel"):
            setattr(_module, _name, _Recorder(_obj))


def record_launches(dtype: torch.dtype, shared_mem: int, cc: int) -> list:
    LAUNCHES.clear()

    def gpu_pdl(device):  # as on such a GPU
        return {"PDL": cc >= 90, "launch_pdl": cc >= 90}

    launch.pdl = gpu_pdl  # (the plugins' kernels get the chain from the backend in use: see main)

    def t(*shape, dt=dtype):
        return torch.randn(*shape).to(dt)

    norm.rms_norm(t(4, 4096), t(4096), 1e-6)
    norm.rms_norm(t(4, 4096), t(4096), 1e-6, t(4, 4096))
    norm.layer_norm(t(4, 1152), t(1152), t(1152), 1e-6)  # vision towers
    for order in (4, 8):  # the norm quantizing its output for the int8 GEMV
        quantized = plane_i8_dot.quantized_blocks(1, 4096, torch.device("cpu"))
        norm.rms_norm(t(1, 4096), t(4096), 1e-6, t(1, 4096), quantized=quantized, order=order)
    norm.layer_norm(t(4, 1152), t(1152), t(1152), 1e-6, t(4, 1152))
    for head_dim in (72, 128):  # Qwen3-VL's and SigLIP's encoders; a power of two
        tiles = (
            encoder_attention.FMA_TILES if dtype == torch.float32 or cc < 80 else encoder_attention.TENSOR_CORE_TILES
        )
        qkv = t(64, 3, 16, head_dim)
        encoder_attention.encoder_attention(*qkv.unbind(1), torch.tensor([0, 40, 64], dtype=torch.int32), 0.1, tiles)
    positions = torch.zeros(4, dtype=torch.int64)
    rotary.rotary(t(4, 32, 128), t(4, 8, 128), positions, t(64, 128, dt=torch.float32))
    rotary.rotary(t(4, 32, 128), t(4, 8, 128), positions, t(64, 64, dt=torch.float32))
    head_norms = HeadNorms(t(128), t(128), 1e-6)  # q/k norms in the same pass
    rotary.rotary(t(4, 16, 128), t(4, 8, 128), positions, t(64, 128, dt=torch.float32), head_norms)
    rotary.rotary(t(4, 8, 256), t(4, 4, 256), positions, t(64, 256, dt=torch.float32), HeadNorms(t(256), t(256), 1e-6))
    # the rotary that stores the keys and values into the cache (Qwen3-30B-A3B's heads)
    slots = torch.zeros(4, dtype=torch.int64)
    rotary.rotary_write_kv(t(4, 32, 128), t(4, 4, 128), t(4, 4, 128), positions, t(64, 128, dt=torch.float32),
                           head_norms, t(8, 16, 4, 128), t(8, 16, 4, 128), slots)  # fmt: skip
    for tile in ONE_ROW_TILES + DOT_TILES:  # the small-batch linear's tiles, as its measurement launches them
        gemv.gemv(t(1 if tile in ONE_ROW_TILES else 4, 4096), t(6144, 4096), None, tile)
    gemv.gemv(t(1, 4096), t(6144, 4096), t(6144), ONE_ROW_TILES[0])
    gemv.gemv(t(4, 4096), t(6144, 4096), t(6144), DOT_TILES[0])
    activation.silu_and_mul(t(4, 2 * 14336))
    activation.gelu_tanh_and_mul(t(4, 2 * 14336))
    activation.gelu_and_mul(t(4, 2 * 14336))
    activation.add_gated(t(1, 2048), t(1, 2048), t(1, 2048), t(1, 2048))  # a shared expert's gate
    activation.sigmoid_gate(t(4, 4096), t(4, 4096))  # an attention's output gate
    kv_write.write_kv(t(4, 8, 128), t(4, 8, 128), t(16, 16, 8, 128), t(16, 16, 8, 128), positions)
    # Mixture of experts at Qwen3-30B-A3B's sizes (weights never written: untouched memory), with
    # the GPU's tiles: the small-batch path (1 and 4 tokens), the grouped one at a 256-row decode
    # step's and a prefill chunk's slots per expert
    moe.gpu_tiles = lambda x: True
    w13, w2 = torch.empty(128, 2 * 768, 2048, dtype=dtype), torch.empty(128, 2048, 768, dtype=dtype)
    for tokens in (1, 4, 256, 8192):
        ids = torch.zeros(tokens, 8, dtype=torch.int32)
        moe.fused_moe(t(tokens, 2048), w13, w2, torch.rand(tokens, 8), ids, "silu")
    # the per-slot path's other variants at batch 1: down in fp32 parts summed after it, and the first kernels
    split = moe.SlotTiles(up_n=32, up_k=128, down_n=8, down_k=128, down_split=2)
    moe.fused_moe(t(1, 2048), w13, w2, torch.rand(1, 8), ids[:1], "silu", split)
    moe.fused_moe(t(1, 2048), w13, w2, torch.rand(1, 8), ids[:1], "silu", replace(split, pipelined=False))
    for tiles in moe.slot_candidates(1, 8, t(1, 2048)):  # the tiles the start-up measurement times (moe_tiles.py)
        moe.fused_moe(t(1, 2048), w13, w2, torch.rand(1, 8), ids[:1], "silu", tiles)
    moe_routing.moe_route(t(4, 128), Routing(top_k=8, renormalize=True), None)
    grouped = Routing(8, "sigmoid", renormalize=True, correction_bias=True, num_groups=8, topk_groups=4)
    moe_routing.moe_route(t(4, 256), grouped, t(256, dt=torch.float32))
    moe_routing.moe_route(t(4, 256), replace(grouped, shared_experts=2), t(256, dt=torch.float32))  # DeepSeek-V3's
    shared_gate = Routing(top_k=8, renormalize=True, shared_experts=1, shared_gate=True)  # Qwen3.6-35B-A3B's
    moe_routing.moe_route(t(4, 257), shared_gate, None)
    for tile in ONE_ROW_TILES[:2] + ONE_PASS_TILES[::3]:  # the router's norm, GEMV and routing in one launch
        norm_linear.norm_route(t(1, 2048), t(1, 2048), t(2048), 1e-6, t(128, 2048), Routing(top_k=8, renormalize=True),
                               None, tile)  # fmt: skip
        norm_linear.norm_route(t(1, 2048), t(1, 2048), t(2048), 1e-6, t(257, 2048), shared_gate, None, tile)
    for tile in ONE_ROW_TILES[:1] + ONE_PASS_TILES[::3]:  # a norm fused into the qkv projection (Qwen3-30B-A3B)
        norm_linear.norm_linear(t(1, 2048), t(1, 2048), t(2048), 1e-6, t(5120, 2048), None, tile)
    # Gated DeltaNet at Qwen3.6-35B-A3B's sizes (16 key heads, 32 value heads of 128): a decode
    # step (the recurrent kernel) and one with prompts (the chunked form); the conv over q, k, v
    for q_len in (1, 100):
        meta = AttentionMetadata(
            torch.tensor([0, q_len, 2 * q_len], dtype=torch.int32), torch.tensor([100, 100], dtype=torch.int32),
            torch.zeros(2, 1, dtype=torch.int32), torch.zeros(2 * q_len, dtype=torch.int64), q_len, 100,
        )  # fmt: skip
        slots = torch.zeros(2, dtype=torch.int32)
        conv1d.causal_conv1d(t(2 * q_len, 8192), t(8192, 4), None, t(4, 8192, 3), meta, slots)
        gates = t(2 * q_len, 64)  # b | a, columns of the layer's projection
        delta_rule.gated_delta_rule(
            t(2 * q_len, 16, 128), t(2 * q_len, 16, 128), t(2 * q_len, 32, 128), gates[:, 32:], gates[:, :32], t(32),
            t(32), t(4, 32, 128, 128, dt=torch.float32), meta, slots,
        )  # fmt: skip
        delta_rule.gated_delta_rule_norm(  # with q_len 1 in one launch, the norm in the recurrent kernel
            t(2 * q_len, 16, 128), t(2 * q_len, 16, 128), t(2 * q_len, 32, 128), gates[:, 32:], gates[:, :32], t(32),
            t(32), t(4, 32, 128, 128, dt=torch.float32), meta, slots, t(2 * q_len, 32, 128), t(128), 1e-6,
        )  # fmt: skip
        gated_norm.gated_rms_norm(t(2 * q_len, 32, 128), t(2 * q_len, 32, 128), t(128), 1e-6)
        # fla's prefill behind the op: our gather and write-back around fla's call (fla's own kernels are not ours)
        fla_prefill.chunk_rule = lambda **call: (call["v"], call["initial_state"])
        fla_prefill.delta_rule(
            t(2 * q_len, 16, 128), t(2 * q_len, 16, 128), t(2 * q_len, 32, 128), t(2 * q_len, 32, dt=torch.float32),
            t(2 * q_len, 32), t(4, 32, 128, 128, dt=torch.float32), meta, slots,
        )  # fmt: skip
    # the chunked form in fp32 too (its own dot precision), at 128 and at the tests' small head dim
    for dim in (128, 16):
        h = t(200, 48 * dim, dt=torch.float32)
        delta_rule.gated_delta_rule(
            h[:, : 16 * dim].view(200, 16, dim), h[:, 16 * dim : 32 * dim].view(200, 16, dim),
            h[:, 32 * dim :].view(200, 16, dim), t(200, 16, dt=torch.float32), t(200, 16, dt=torch.float32),
            t(16, dt=torch.float32), t(16, dt=torch.float32), t(4, 16, dim, dim, dt=torch.float32), meta, slots,
        )  # fmt: skip
    rows = [SampledRow(SamplingParams(temperature=0.8, top_p=0.95, top_k=50), 1, 10)] * 4
    sampling.sample(t(4, 151936), SamplingBatch.of(rows))
    words = torch.zeros(2, 151936 // 32, dtype=torch.int32)
    token_bitmask.apply_token_bitmask(t(4, 151936, dt=torch.float32), words, torch.tensor([0, 3], dtype=torch.int32))
    # GGUF-packed weights (never written), each format's own decoding: the one-row GEMV with whole
    # tiles and with cut ones (rows past the last tile, a bias), the dot kernel at a small batch's and a
    # prefill's tiles, dequantization, and the MoE per-slot kernels at Qwen3-30B-A3B's sizes; FP8 decoded
    # as the target does (through its e4m3 conversion from SM89)
    quant_linear.converts_e4m3 = lambda device: cc >= 89
    if cc >= 89:  # FP8 weights in the tensor cores' layout at one row (its GEMV converts e4m3 in hardware)
        for warps in GEMV_WARPS:
            fp8_gemv.fp8_gemv(
                t(1, 4096), torch.empty(6144, 4096, dtype=torch.uint8), torch.empty(32, 6144), None, warps
            )
            fp8_gemv.fp8_gemv(
                t(1, 4224), torch.empty(6142, 4224, dtype=torch.uint8), torch.empty(33, 6142), t(6142), warps
            )
    for fmt in FORMATS.values():
        packed = torch.empty(6144, fmt.row_bytes(4096), dtype=torch.uint8)
        for tokens in (1, 4, 300):
            quant_linear.quant_linear(t(tokens, 4096), packed, fmt.name)
        quant_linear.quant_linear(t(1, 4096), packed[:6142], fmt.name, t(6142))
        quant_linear.dequantize(packed, fmt.name, 4096, dtype)
        w13 = torch.empty(128, 2 * 768, fmt.row_bytes(2048), dtype=torch.uint8)
        w2 = torch.empty(128, 2048, fmt.row_bytes(768), dtype=torch.uint8)
        to_expert_0 = torch.zeros(1, 8, dtype=torch.int32)
        quant_moe.fused_moe(t(1, 2048), w13, w2, fmt.name, torch.rand(1, 8), to_expert_0, "silu")
        if fmt.name in MEASURED_FORMATS:
            for tokens in (1, 16, 32, 64):
                for tile in candidates(fmt, tokens):  # (the dequantized candidate: dequantize's kernel, above)
                    if tile is not quant_linear.DEQUANTIZED:
                        quant_linear.quant_linear(t(tokens, 4096), packed, fmt.name, None, tile)
    # GGUF weights in planes (a linear's weight as the backend lays it out at load): every tile the
    # measurement tries of each type's GEMV and dots, with a bias and cut tiles, and dequantization
    for layout in LAYOUTS.values():
        planes = torch.empty(6142 * 4096 // layout.tile * sum(layout.tile_bytes()), dtype=torch.uint8)
        for tokens in (1, 16, 64):
            for tile in plane_candidates(layout, tokens, int8_tensor_cores=cc >= 80):
                if tile is not quant_linear.DEQUANTIZED:
                    plane_linear.plane_rows(t(tokens, 4096), planes, layout.name, None, tile)
        plane_linear.plane_rows(t(1, 4096), planes, layout.name, t(6142))
        down = torch.empty(4096 * 14336 // layout.tile * sum(layout.tile_bytes()), dtype=torch.uint8)
        plane_linear.plane_rows(t(1, 14336), down, layout.name)  # a K no loop step of 16 tiles divides
        plane_linear.plane_dequantize(planes, layout.name, 6142, 4096, dtype)
    # Multi-head latent attention at DeepSeek V3's sizes (R 512, P 64; 128 heads, and V2-Lite's 16), bf16 and
    # fp8 rows: the store, decode with and without splits, prefill
    mla_tiles = {fp8: mla.TILES["fma" if cc < 80 or dtype == torch.float32 else "gpu-fp8" if fp8 else "gpu"]
                 for fp8 in (False, True)}  # fmt: skip
    for heads, q_len, num_splits in [(128, 1, 4), (128, 1, 1), (16, 1, 4), (128, 8, None), (16, 8, None)]:
        cu = torch.tensor([0, q_len, 2 * q_len], dtype=torch.int32)
        meta = AttentionMetadata(
            cu, torch.tensor([100, 100], dtype=torch.int32), torch.zeros(2, 256, dtype=torch.int32),
            torch.zeros(2 * q_len, dtype=torch.int64), q_len, 100,
        )  # fmt: skip
        queries = (t(2 * q_len, heads, 512), t(2 * q_len, heads, 64), t(2 * q_len, 576))
        mla.mla_attention(*queries, t(4, 64, 576), meta, 0.1, num_splits=num_splits, tiles=mla_tiles[False])
        # the rows stored by mla_rows, the values up-projected in the decode's merge (q_len 1) or after
        w_uv = t(heads, 128, 512)
        mla.mla_attention(*queries[:2], None, t(4, 64, 576), meta, 0.1, w_uv, num_splits=num_splits,
                          tiles=mla_tiles[False])  # fmt: skip
        # the rows (stored, or not), rotary parts and absorbed queries (w_uk in the launch at 2 tokens, beside it
        # at 16)
        rotation = Rotation(torch.zeros(2 * q_len, dtype=torch.int64), t(4096, 64, dt=torch.float32))
        projected = (t(2 * q_len, heads, 192), t(2 * q_len, 576), rotation, t(512), 1e-6, t(heads, 128, 512))
        mla_rows.mla_rows(*projected)
        mla_rows.mla_rows(*projected, t(4, 64, 576), meta.slot_mapping)
        fp8_cache = torch.zeros(4, 64, 656, dtype=torch.uint8)
        mla.mla_attention_fp8(*queries, fp8_cache, meta, 0.1, num_splits=num_splits, tiles=mla_tiles[True])
        # V3.2's sparse attention over 2048 selected rows of the latent cache, and its indexer (64 heads of 128)
        selected = torch.zeros(2 * q_len, 2048, dtype=torch.int32)
        sparse_mla.sparse_mla_attention(*queries, t(4, 64, 576), meta, 0.1, selected)
        indexer.indexer_topk(
            t(2 * q_len, 64, 128), t(2 * q_len, 128), t(2 * q_len, 64), t(4, 64, 128), meta, 0.1, 2048
        )  # fmt: skip

    # the GPU tests' tiny shape (4 heads, R 32, P 8, nope 24: narrower than tl.dot's 16 rows, padded), decode and
    # prefill, the rows stored beside and by mla_rows
    for q_len in (1, 8):
        cu = torch.tensor([0, q_len, 2 * q_len], dtype=torch.int32)
        meta = AttentionMetadata(
            cu, torch.tensor([40, 40], dtype=torch.int32), torch.zeros(2, 8, dtype=torch.int32),
            torch.zeros(2 * q_len, dtype=torch.int64), q_len, 40,
        )  # fmt: skip
        queries = (t(2 * q_len, 4, 32), t(2 * q_len, 4, 8), t(2 * q_len, 40))
        mla.mla_attention(*queries, t(4, 16, 40), meta, 0.1, tiles=mla_tiles[False])
        mla.mla_attention(*queries[:2], None, t(4, 16, 40), meta, 0.1, t(4, 16, 32), tiles=mla_tiles[False])
        rotation = Rotation(torch.zeros(2 * q_len, dtype=torch.int64), t(4096, 8, dt=torch.float32))
        mla_rows.mla_rows(t(2 * q_len, 4, 32), t(2 * q_len, 40), rotation, t(32), 1e-6, t(4, 24, 32),
                          t(4, 16, 40), meta.slot_mapping)  # fmt: skip

    element_size = torch.tensor([], dtype=dtype).element_size()

    def tiles(table, head_dim):  # what attention._pick chooses on such a device
        if cc < 80 or dtype == torch.float32:
            return attention._FMA_TILES
        candidates = table[min(d for d in table if d >= head_dim)]
        fitting = [c for c in candidates if attention._shared_bytes(c, head_dim, element_size) <= shared_mem]
        return fitting[0] if fitting else attention._FMA_TILES

    # (head dim, heads, kv heads, window, softcap, [(q_len, decode splits), ...])
    variants = [
        (128, 32, 8, None, None, [(1, 4), (1, 1), (8, None)]),
        (256, 8, 4, 512, 50.0, [(1, 4), (8, None)]),
        (64, 32, 32, 128, None, [(8, None)]),
        (32, 8, 8, None, 30.0, [(1, 2)]),
    ]
    for head_dim, heads, kv_heads, window, softcap, steps in variants:
        for q_len, num_splits in steps:
            cu = torch.tensor([0, q_len, 2 * q_len], dtype=torch.int32)
            meta = AttentionMetadata(
                cu, torch.tensor([100, 100], dtype=torch.int32), torch.zeros(2, 256, dtype=torch.int32),
                torch.zeros(2 * q_len, dtype=torch.int64), q_len, 100,
            )  # fmt: skip
            cache = t(4, 16, kv_heads, head_dim)
            # with a window and several queries also with key limits (Gemma 3's image tokens)
            for key_limits in [None] + ([torch.arange(2 * q_len, dtype=torch.int32)] if q_len > 1 and window else []):
                attention.paged_attention(
                    t(2 * q_len, heads, head_dim), cache, cache.clone(), replace(meta, key_limits=key_limits), 0.1,
                    window, softcap, num_splits=num_splits, prefill_tiles=tiles(attention._PREFILL_TILES, head_dim),
                    decode_tiles=tiles(attention._DECODE_TILES, head_dim),
                )  # fmt: skip
    # Quantized caches: the write kernel (both sides) and attention (decode and prefill).
    for name in QUANTIZED:
        fmt = get_format(name)
        for head_dim in (64, 128, 256):
            cache = fmt.allocate(4, 16, 8, head_dim, dtype, torch.device("cpu"))
            cache.equalizer = t(8, head_dim, dt=torch.float32) if fmt.rotate_keys else None
            cache.key_offset = t(8, head_dim, dt=torch.float32) if fmt.rotate_keys else None
            for tokens in (4, 300):  # decode and prefill tiles; with the queries, as attention writes
                kv_quant_write.quant_write_kv(
                    t(tokens, 8, head_dim), t(tokens, 8, head_dim), cache, torch.zeros(tokens, dtype=torch.int64),
                    t(tokens, 32, head_dim),
                )  # fmt: skip
            # The decode tiles of small batches and of batches that fill the GPU; codes
            # decoded as on such a GPU.
            sides = (kv_codes.side(cache, "k", fmt.key), kv_codes.side(cache, "v", fmt.value))
            long_tiles = attention.long_tiles_fit(sides, cc // 10)
            decode_tables = [attention._DECODE_TILES] + ([attention._LONG_DECODE_TILES] if long_tiles else [])
            steps = [(1, 4, tiles(table, head_dim)) for table in decode_tables] + [
                (8, None, tiles(attention._DECODE_TILES, head_dim))
            ]
            for q_len, num_splits, decode_tiles in steps:
                cu = torch.tensor([0, q_len, 2 * q_len], dtype=torch.int32)
                meta = AttentionMetadata(
                    cu, torch.tensor([100, 100], dtype=torch.int32), torch.zeros(2, 256, dtype=torch.int32),
                    torch.zeros(2 * q_len, dtype=torch.int64), q_len, 100,
                )  # fmt: skip
                attention.paged_attention_cache(
                    t(2 * q_len, 32, head_dim), cache, meta, 0.1, num_splits=num_splits,
                    prefill_tiles=tiles(attention._PREFILL_TILES, head_dim), decode_tiles=decode_tiles,
                    decode=kv_codes.gpu_decode_method(divmod(cc, 10)),
                )  # fmt: skip
            # A recent window: shadow writes, and attention reading shadows. Its own code
            # is the same at every head dim and for every format, and its kernels are the
            # slowest to compile (15-26 s each on a busy 2-core machine): one head dim and
            # WINDOW_FORMATS keep this check's time well within CI's.
            if head_dim != 128 or name not in WINDOW_FORMATS:
                continue
            cache.shadows, cache.recent_window = (t(4, 16, 8, head_dim), t(4, 16, 8, head_dim)), 64
            slots = torch.zeros(4, dtype=torch.int64)
            kv_quant_write.write_shadow_kv(t(4, 8, head_dim), t(4, 8, head_dim), cache, slots)
            # the attention op's store: codes, shadows and queries in one launch
            kv_quant_write.quant_write_kv(t(4, 8, head_dim), t(4, 8, head_dim), cache, slots, t(4, 32, head_dim), slots)
            for q_len, num_splits, decode_table in [(1, 4, table) for table in decode_tables] + [(8, None, None)]:
                cu = torch.tensor([0, q_len, 2 * q_len], dtype=torch.int32)
                meta = AttentionMetadata(
                    cu, torch.tensor([100, 100], dtype=torch.int32), torch.zeros(2, 256, dtype=torch.int32),
                    torch.zeros(2 * q_len, dtype=torch.int64), q_len, 100,
                    ShadowPages(torch.zeros(2, 256, dtype=torch.int32), torch.zeros(2 * q_len, dtype=torch.int64)),
                )  # fmt: skip
                prefill = tiles(attention._PREFILL_TILES, head_dim)
                if sides[0].code == kv_codes.LLOYD:  # as attention halves them
                    prefill = replace(prefill, block_n=max(prefill.block_n // 2, 16))
                attention.paged_attention_cache(
                    t(2 * q_len, 32, head_dim), cache, meta, 0.1, num_splits=num_splits, prefill_tiles=prefill,
                    decode_tiles=tiles(decode_table or attention._DECODE_TILES, head_dim),
                    decode=kv_codes.gpu_decode_method(divmod(cc, 10)),
                )  # fmt: skip
            cache.shadows = None
    return list(LAUNCHES)


def compile_launch(fn, args, kwargs, target: GPUTarget):
    """Compile as the JIT would for these arguments (16-byte aligned pointers, ints
    divisible by 16 marked so)."""
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, arg) in enumerate(zip(fn.arg_names, args)):
        if isinstance(arg, torch.Tensor):
            signature[name] = POINTER_TYPES[arg.dtype]
        elif isinstance(arg, bool):
            signature[name] = "i1"
        elif isinstance(arg, int):
            signature[name] = "i32" if abs(arg) < 2**31 else "i64"
        else:
            signature[name] = "fp32"
        specialized = name not in fn.do_not_specialize  # (as the JIT: such ints are not marked)
        if isinstance(arg, torch.Tensor) or (type(arg) is int and arg % 16 == 0 and specialized):
            attrs[(i,)] = [["tt.divisibility", 16]]
    for name in fn.arg_names[len(args) :]:
        signature[name] = "constexpr"
        constexprs[name] = kwargs[name]
    options = {k: v for k, v in kwargs.items() if k not in fn.arg_names}
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options)


def resource_usage(cubin: bytes) -> str:
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        report = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", report)
    return f"regs {found.group(1)} stack {found.group(2)}" if found else ""


def _compile(job: tuple[int, int]) -> str:
    """One line of the report for ``LAUNCHES[index]`` compiled for ``cc`` (in a worker
    forked after :func:`record_launches`, which inherits the launches)."""
    index, cc = job
    fn, call_args, kwargs = LAUNCHES[index]
    label = f"sm_{cc} {fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__} { {n: kwargs[n] for n in fn.arg_names if n in kwargs} }"
    try:
        kernel = compile_launch(fn, call_args, kwargs, GPUTarget("cuda", cc, 32))
    except Exception as error:  # noqa: BLE001 - report every failure, not just the first
        return f"FAIL {label}: {type(error).__name__}: {error}"
    barriers = kernel.asm["ptx"].count("bar.sync")
    if barriers > BARRIERS.get(fn.__name__, barriers):
        return f"FAIL {label}: {barriers} barriers, {BARRIERS[fn.__name__]} expected: a layout conversion"
    return f"ok   {label} shared {kernel.metadata.shared} {resource_usage(kernel.asm['cubin'])}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("targets", nargs="*", type=int, default=[90, 80])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="compiles at once")
    args = parser.parse_args(argv)
    assert not os.environ.get("TRITON_INTERPRET"), "run without TRITON_INTERPRET"
    dtype = getattr(torch, args.dtype)
    shared_mem = {70: 98304, 75: 65536, 80: 166912, 86: 101376, 89: 101376, 90: 232448}
    failures = 0
    for cc in args.targets:
        with ops.use(CudaOps()):
            record_launches(dtype, shared_mem.get(cc, 101376), cc)
        unique = {}
        for index, (fn, _, kwargs) in enumerate(LAUNCHES):
            unique.setdefault((fn, repr(sorted(kwargs.items()))), index)  # (kernels of several modules share names)
        with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
            for line in pool.imap(_compile, [(index, cc) for index in unique.values()]):
                failures += line.startswith("FAIL")
                print(line, flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

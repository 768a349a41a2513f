"""The small ops of one batch-1 decode layer at Qwen3-30B-A3B's shapes, each alone, the path
before the fusions of issues #31/#32 beside the one now taken; one JSON line per (op, path).

    python benchmarks/decode_layer.py [--ops attention rotary router qkv experts] [--contexts 140 1024 8192]
                                      [--max-context 40960] [--no-pdl] [--one-tile-splits]
    python benchmarks/decode_layer.py --smoke   # tiny shapes on the CPU under the Triton interpreter

Ops and paths:

- ``attention``: decode attention of one query (32 heads, 4 KV heads of 128, bf16 cache of
  16-token blocks) over ``--contexts`` keys, in a grid sized for ``--max-context`` as a CUDA
  graph captured for the engine's longest context is (``graph grid``), beside the grid a graph
  captured for that context alone would have (``context grid``); a short context runs only the
  splits it fills, so the two should be close. Each also without the L2 prefetch of the split's
  keys before the wait for the kernel before (``no prefetch``: the path before it; with PDL
  only), and the context grid in one split (no merge). ``--one-tile-splits`` adds the graph grid
  with splits of one key tile (a candidate: the engine's splits take at least two,
  ``attention._min_split``).
- ``rotary+kv write``: q/k norms and rotary of one token, and its K/V stored into the paged
  cache: ``rotary, write_kv`` (two launches, the rotated k written and read back) against
  ``rotary_write_kv`` (one launch, k rotated straight into the cache).
- ``router``: the router's norm, its 128 x 2048 projection and the top-8 routing:
  ``rms_norm, linear, moe_route`` (three launches: what the engine measured fastest before the
  one-pass tiles), ``norm_linear, moe_route`` (two launches) and ``norm_route`` (one launch, the
  last program routes) in the two-pass tiles and in the one-pass ones (``one_pass``: the mean
  square summed in the product's loop), each in every tile, the fastest reported (as the
  engine measures). All use today's routing math.
- ``qkv``: the attention's norm and its 5120 x 2048 projection: ``rms_norm, linear`` (the
  linear as the engine measures it: cuBLAS or the fastest tile) against ``norm_linear`` in the
  two-pass and the one-pass tiles.
- ``experts``: the fused MoE of one token (8 of 128 experts, 75 MB a call) in the heuristic's
  tiles (``slot_tiles``) and in the fastest of the start-up measurement's candidates
  (``slot_candidates``, xinfer_cuda/moe_tiles.py), over routings to random experts.

Where a call is bound by its bytes, ``fraction`` is their rate over the copy bandwidth
(bandwidth.py; not with ``--smoke``).

Method: ``COPIES`` layers' inputs (a cache, a weight per layer) so that consecutive calls read
other memory, as a step's layers do; a CUDA graph of a call per layer, replayed five times
between ``torch.cuda.Event`` records, the best replay divided by the calls. ``bytes`` are what
a call must move (the context's K/V, the token's q/k/v in and out, the router's weight), and
``bytes_per_us`` their rate. Each pair of paths is checked to agree before it is timed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

QWEN3_30B_A3B = dict(hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8, moe_intermediate=768,
                     block_size=16)  # fmt: skip
SMOKE = dict(hidden=64, heads=4, kv_heads=1, head_dim=64, experts=16, top_k=4, moe_intermediate=48, block_size=16)
COPIES = 48  # a layer's inputs per decode step
EPS = 1e-6


@dataclass
class Setup:
    shape: dict
    device: torch.device
    dtype: torch.dtype
    smoke: bool
    copies: int


def per_call_us(calls: list[Callable[[], object]], setup: Setup) -> float:
    """Microseconds per call of ``calls`` run in order (a CUDA graph of them on the GPU)."""
    if setup.smoke:
        start = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - start) * 1e6 / len(calls)
    from xinfer_cuda.linear import graph_time  # the backend's timer: a CUDA graph cycling over the calls

    return graph_time(lambda call: call(), calls) * 1e6


BANDWIDTH = [math.nan]  # bytes per second of a device copy, once measured


def report(op: str, path: str, us: float, nbytes: int, **extra) -> None:
    line = dict(op=op, path=path, us=round(us, 2), bytes=nbytes, bytes_per_us=round(nbytes / us), **extra)
    if not math.isnan(BANDWIDTH[0]):
        line["fraction"] = round(nbytes / (us * 1e-6) / BANDWIDTH[0], 3)
    print(json.dumps(line), flush=True)


def fastest(paths: dict[str, Callable], tiles: dict[str, tuple], weights: list[torch.Tensor], setup: Setup,
            op: str, nbytes: int) -> None:  # fmt: skip
    """Each path in each of its tiles over the layers' weights, the fastest tile reported."""
    for path, fn in paths.items():
        times = {
            tile: per_call_us([lambda w=w, t=tile, fn=fn: fn(w, t) for w in weights], setup) for tile in tiles[path]
        }
        best = min(times, key=times.__getitem__)
        report(op, path, times[best], nbytes, tile=str(best))


def rand(setup: Setup, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=setup.device) * scale).to(setup.dtype)


def agree(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    err = ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
    assert err < 2e-2, f"{what}: the paths disagree (relative error {err:.1e})"


def attention_case(setup: Setup, context: int, max_context: int, one_tile_splits: bool) -> None:
    from xinfer.kv import LayerKVCache
    from xinfer.ops import AttentionMetadata
    from xinfer_cuda.kernels import attention

    s = setup.shape
    block_size, kv_heads, head_dim = s["block_size"], s["kv_heads"], s["head_dim"]
    blocks = math.ceil(context / block_size)
    table = torch.zeros(1, math.ceil(max_context / block_size), dtype=torch.int32, device=setup.device)
    table[0, :blocks] = torch.randperm(blocks, device=setup.device, dtype=torch.int32)
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32, device=setup.device),
        seq_lens=torch.tensor([context], dtype=torch.int32, device=setup.device),
        block_tables=table,
        slot_mapping=torch.tensor([context - 1], dtype=torch.int64, device=setup.device),
        max_seqlen_q=1,
        max_seq_len=context,
    )
    caches = [
        LayerKVCache.plain(rand(setup, blocks, block_size, kv_heads, head_dim), rand(setup, blocks, block_size, kv_heads, head_dim))
        for _ in range(setup.copies)
    ]  # fmt: skip
    q = rand(setup, 1, s["heads"], head_dim)
    context_meta = replace(meta, block_tables=table[:, :blocks])
    paths = {  # name: (metadata, attention's overrides)
        "graph grid": (meta, {}),
        "context grid": (context_meta, {}),
        "graph grid, no prefetch": (meta, dict(prefetch=False)),
        "context grid, no prefetch": (context_meta, dict(prefetch=False)),
        "context grid, one split": (context_meta, dict(num_splits=1)),
    }
    reference = attention.paged_attention_cache(q, caches[0], context_meta, head_dim**-0.5, prefetch=False)
    nbytes = 2 * context * kv_heads * head_dim * q.element_size() + 2 * q.numel() * q.element_size()
    for path, (m, overrides) in paths.items():
        calls = [lambda c=c, m=m, o=overrides: attention.paged_attention_cache(q, c, m, head_dim**-0.5, **o)
                 for c in caches]  # fmt: skip
        agree(calls[0](), reference, f"attention ({path})")
        report("attention", path, per_call_us(calls, setup), nbytes, context=context, max_context=max_context)
    if one_tile_splits:  # a candidate, not the engine's: splits of one key tile (two today), shorter chains
        two_tiles = attention._min_split
        attention._min_split = lambda cfg: cfg.block_n
        try:
            for path, overrides in (("graph grid, one-tile splits", {}),
                                    ("graph grid, one-tile splits, no prefetch", dict(prefetch=False))):  # fmt: skip
                calls = [lambda c=c, o=overrides: attention.paged_attention_cache(q, c, meta, head_dim**-0.5, **o)
                         for c in caches]  # fmt: skip
                agree(calls[0](), reference, f"attention ({path})")
                report("attention", path, per_call_us(calls, setup), nbytes, context=context, max_context=max_context)
        finally:
            attention._min_split = two_tiles


def rotary_case(setup: Setup) -> None:
    from xinfer.ops import HeadNorms
    from xinfer_cuda.kernels import kv_write, rotary

    s = setup.shape
    heads, kv_heads, head_dim, block_size = s["heads"], s["kv_heads"], s["head_dim"], s["block_size"]
    qkv = rand(setup, 1, (heads + 2 * kv_heads) * head_dim)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    q, k, v = q.view(1, heads, head_dim), k.view(1, kv_heads, head_dim), v.view(1, kv_heads, head_dim)
    positions = torch.tensor([139], device=setup.device)
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, head_dim, 2, device=setup.device).float() / head_dim)
    angles = torch.outer(torch.arange(4096, device=setup.device).float(), inv_freq)
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
    norms = HeadNorms(rand(setup, head_dim), rand(setup, head_dim), EPS)
    caches = [(rand(setup, 16, block_size, kv_heads, head_dim), rand(setup, 16, block_size, kv_heads, head_dim))
              for _ in range(setup.copies)]  # fmt: skip
    slots = torch.tensor([139], device=setup.device)

    def old(kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        q_out, k_out = rotary.rotary(q, k, positions, cos_sin, norms)
        kv_write.write_kv(k_out, v, kc, vc, slots)
        return q_out

    def new(kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        return rotary.rotary_write_kv(q, k, v, positions, cos_sin, norms, kc, vc, slots)

    (k0, v0), (k1, v1) = caches[0], caches[1]
    agree(new(k1, v1), old(k0, v0), "rotary q")
    agree(k1.view(-1, kv_heads, head_dim)[139], k0.view(-1, kv_heads, head_dim)[139], "rotary k")
    nbytes = 2 * qkv.numel() * qkv.element_size()  # q, k, v read; q, k, v written
    for path, fn in (("rotary, write_kv", old), ("rotary_write_kv", new)):
        calls = [lambda c=c, fn=fn: fn(*c) for c in caches]
        report("rotary+kv write", path, per_call_us(calls, setup), nbytes)


def router_case(setup: Setup) -> None:
    from xinfer.layers.moe import Routing
    from xinfer_cuda.kernels import moe_routing, norm
    from xinfer_cuda.kernels.gemv import gemv
    from xinfer_cuda.kernels.norm_linear import norm_linear, norm_route
    from xinfer_cuda.linear import ONE_PASS_TILES, ONE_ROW_TILES

    s = setup.shape
    routing = Routing(top_k=s["top_k"], renormalize=True)
    x, residual = rand(setup, 1, s["hidden"]), rand(setup, 1, s["hidden"])
    norm_weight = rand(setup, s["hidden"])
    weights = [rand(setup, s["experts"], s["hidden"], scale=0.05) for _ in range(setup.copies)]
    tiles = ONE_ROW_TILES[:3] if setup.smoke else ONE_ROW_TILES
    one_pass = ONE_PASS_TILES[:2] if setup.smoke else ONE_PASS_TILES

    def apart(w: torch.Tensor, tile) -> tuple[torch.Tensor, torch.Tensor]:
        normed, _ = norm.rms_norm(x, norm_weight, EPS, residual)
        return moe_routing.moe_route(gemv(normed, w, None, tile), routing, None)

    def old(w: torch.Tensor, tile) -> tuple[torch.Tensor, torch.Tensor]:
        logits, _, _ = norm_linear(x, residual, norm_weight, EPS, w, None, tile)
        return moe_routing.moe_route(logits, routing, None)

    def new(w: torch.Tensor, tile) -> tuple[torch.Tensor, torch.Tensor]:
        routed = norm_route(x, residual, norm_weight, EPS, w, routing, None, tile)
        assert routed is not None
        return routed[0], routed[1]

    old_weights, old_ids = apart(weights[0], tiles[0])
    for fn, tile in ((old, tiles[0]), (new, tiles[0]), (old, one_pass[0]), (new, one_pass[0])):
        new_weights, new_ids = fn(weights[0], tile)
        assert torch.equal(old_ids, new_ids), f"router: {fn.__name__} in {tile} chose other experts"
        agree(new_weights, old_weights, "router weights")
    nbytes = weights[0].numel() * weights[0].element_size() + 2 * x.numel() * x.element_size()
    paths = {"rms_norm, linear, moe_route": apart, "norm_linear, moe_route": old, "norm_route": new,
             "norm_linear, moe_route (one pass)": old, "norm_route (one pass)": new}  # fmt: skip
    path_tiles = {path: one_pass if "one pass" in path else tiles for path in paths}
    fastest(paths, path_tiles, weights, setup, "router", nbytes)


def qkv_case(setup: Setup) -> None:
    from xinfer_cuda.kernels import norm
    from xinfer_cuda.kernels.norm_linear import norm_linear
    from xinfer_cuda.linear import ONE_PASS_TILES, SmallBatchLinear, candidates

    s = setup.shape
    rows = (s["heads"] + 2 * s["kv_heads"]) * s["head_dim"]
    x, residual = rand(setup, 1, s["hidden"]), rand(setup, 1, s["hidden"])
    norm_weight = rand(setup, s["hidden"])
    weights = [rand(setup, rows, s["hidden"], scale=0.05) for _ in range(setup.copies)]
    linear = SmallBatchLinear()  # cuBLAS or its fastest tile, measured as the engine does
    tiles = candidates(1)[:3] if setup.smoke else candidates(1)
    one_pass = ONE_PASS_TILES[:2] if setup.smoke else ONE_PASS_TILES

    def apart(w: torch.Tensor, tile) -> torch.Tensor:
        normed, _ = norm.rms_norm(x, norm_weight, EPS, residual)
        return linear(normed, w) if x.is_cuda else torch.nn.functional.linear(normed, w)

    def fused(w: torch.Tensor, tile) -> torch.Tensor:
        return norm_linear(x, residual, norm_weight, EPS, w, None, tile)[0]

    expected = apart(weights[0], None)
    for tile in (tiles[0], one_pass[0]):
        agree(fused(weights[0], tile), expected, f"qkv in {tile}")
    nbytes = weights[0].numel() * weights[0].element_size() + 2 * x.numel() * x.element_size()
    paths = {"rms_norm, linear": apart, "norm_linear": fused, "norm_linear (one pass)": fused}
    path_tiles = {"rms_norm, linear": (None,), "norm_linear": tiles, "norm_linear (one pass)": one_pass}
    fastest(paths, path_tiles, weights, setup, "qkv", nbytes)


def experts_case(setup: Setup) -> None:
    from xinfer_cuda.kernels import moe
    from xinfer_cuda.moe_tiles import random_steps

    s = setup.shape
    experts, hidden, top_k = s["experts"], s["hidden"], s["top_k"]
    inter = s["moe_intermediate"]
    w13 = rand(setup, experts, 2 * inter, hidden, scale=hidden**-0.5)
    w2 = rand(setup, experts, hidden, inter, scale=inter**-0.5)
    x = rand(setup, 1, hidden)
    steps = random_steps(x, experts, top_k, setup.copies)
    heuristic = moe.slot_tiles(1, top_k, x)
    candidates = moe.slot_candidates(1, top_k, x) or (replace(heuristic, up_unroll=2),)  # (interpreter: one)
    expected = moe.fused_moe(*steps[0][:1], w13, w2, *steps[0][1:], "silu", heuristic)
    nbytes = top_k * 3 * hidden * inter * w2.element_size()
    for path, options in (("slot_tiles", (heuristic,)), ("fastest of slot_candidates", candidates)):
        times = {}
        for tiles in options:
            agree(moe.fused_moe(*steps[0][:1], w13, w2, *steps[0][1:], "silu", tiles), expected, f"experts in {tiles}")
            calls = [lambda st=st, t=tiles: moe.fused_moe(st[0], w13, w2, st[1], st[2], "silu", t) for st in steps]
            times[tiles] = per_call_us(calls, setup)
        best = min(times, key=times.__getitem__)
        report("experts", path, times[best], nbytes, tile=str(best))


CASES: dict[str, Callable[[Setup], None] | None] = {
    "attention": None,  # (over each of --contexts)
    "rotary": rotary_case,
    "router": router_case,
    "qkv": qkv_case,
    "experts": experts_case,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[140, 1024, 8192])
    parser.add_argument("--max-context", type=int, default=40960, help="the context the graph's grid is sized for")
    parser.add_argument("--no-pdl", action="store_true", help="launch without programmatic dependent launch")
    parser.add_argument("--one-tile-splits", action="store_true", help="also time decode splits of one key tile")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU, Triton interpreter (times meaningless)")
    parser.add_argument("--ops", nargs="+", choices=list(CASES), default=list(CASES), help="the ops timed (all)")
    args = parser.parse_args()
    if args.smoke and os.environ.get("TRITON_INTERPRET") != "1":  # the interpreter is chosen when triton is imported
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "TRITON_INTERPRET": "1"})
    from xinfer_cuda.kernels import launch

    if args.no_pdl:
        launch.pdl = lambda device: {"PDL": False, "launch_pdl": False}
    if args.smoke:
        setup = Setup(SMOKE, torch.device("cpu"), torch.float32, True, 2)
        contexts, max_context = [20, 140], 1024
    else:
        from bandwidth import copy_bandwidth

        BANDWIDTH[0] = copy_bandwidth()
        print(json.dumps({"copy_bandwidth_TBps": round(BANDWIDTH[0] / 1e12, 3)}), flush=True)
        setup = Setup(QWEN3_30B_A3B, torch.device("cuda"), torch.bfloat16, False, COPIES)
        contexts, max_context = args.contexts, args.max_context
    torch.manual_seed(0)
    for op in args.ops:
        if op == "attention":
            for context in contexts:
                attention_case(setup, context, max_context, args.one_tile_splits)
        else:
            CASES[op](setup)


if __name__ == "__main__":
    main()

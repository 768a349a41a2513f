"""Time the fused-MoE op at small decode batches over the per-slot path's tile variants; one
JSON line per (shape, tokens, variant), and per (shape, tokens) a last line naming the winner.

    python benchmarks/moe_kernels.py [--shapes qwen3-30b-a3b glm-4.5-air] [--tokens 1 2 4 8 16]
    python benchmarks/moe_kernels.py --smoke   # tiny shapes on the CPU under the Triton interpreter

Expert shapes (E experts of H x I, k active per token), bf16: Qwen3-30B-A3B (128, 2048, 768, 8)
and GLM-4.5-Air (128, 4096, 1408, 8), at 1, 2, 4, 8 and 16 tokens.

Method: one layer's weights for all E experts; 32 random routings (k distinct experts per
token) with inputs of their own, so that consecutive calls mostly read other experts, as the
layers of a decode step do; a CUDA graph of the 32 calls (its launch gaps are a captured
step's) timed by ``triton.testing.do_bench`` (median of its replays, the L2 flushed before
each). ``bytes`` are the routed experts' weights (each distinct expert of a call once, mean
over the routings), ``fraction`` their rate over the copy bandwidth (bandwidth.py). Every
variant's output for one routing is checked against the torch reference (fp32).

The sweep, per (shape, tokens): ``default`` (what ``fused_moe`` picks: at 16 tokens the
grouped path) and ``first`` (the first per-slot kernels); round 1, the down variants with
the first gate/up tiles; round 2, gate/up's with round 1's best down; the ``best`` line names
the fastest per-slot tiles; round 3, gate/up and down in one launch (``fused``: down's
columns multiplied in each gate/up program, summed with atomics), in the tiles the start-up
measurement tries (``slot_candidates``).

    down  j: slots per program (0: all k), split: chunks of I (parts > 1: fp32 partials
          and a fixed-order sum launch), n x k: the tile's rows of H and columns of I
    up    n x k: the tile's rows of I and columns of H
    w: warps; unroll: steps whose loads are issued together
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict

import torch

SHAPES = {  # experts, hidden, intermediate, top_k
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "glm-4.5-air": (128, 4096, 1408, 8),
}
SMOKE_SHAPES = {"tiny": (16, 64, 48, 4)}
ROUTINGS = 32
TOLERANCE = 2e-2  # relative error of a bf16 result against the fp32 reference

# round 1: down variants (down_j, down_split, down_n, down_k, down_warps, down_unroll), gate/up at its first tiles
DOWN = [
    (0, 1, 8, 128, 4, 1),
    (0, 1, 8, 128, 4, 2),
    (0, 1, 8, 128, 8, 1),
    (0, 1, 4, 128, 4, 1),
    (0, 2, 4, 128, 4, 1),
    (0, 1, 16, 128, 8, 1),
    (0, 2, 8, 128, 4, 1),
    (0, 3, 16, 128, 8, 1),
    (0, 6, 8, 128, 4, 1),
    (1, 1, 16, 256, 4, 1),
    (1, 1, 32, 256, 4, 1),
    (1, 1, 64, 128, 4, 1),
    (1, 3, 16, 256, 4, 1),
    (1, 3, 32, 256, 4, 1),
    (2, 1, 16, 256, 4, 1),
    (4, 1, 16, 128, 4, 1),
]
# round 2: gate/up variants (up_n, up_k, up_warps, up_unroll), down at round 1's best
UP = [
    (32, 128, 4, 1),
    (32, 128, 8, 1),
    (16, 128, 4, 1),
    (16, 256, 4, 1),
    (8, 256, 4, 1),
    (32, 256, 8, 1),
    (64, 64, 4, 1),
    (32, 128, 4, 2),
    (16, 256, 4, 2),
]
FIRST_UP = UP[0]
DOWN_FIELDS = ("down_j", "down_split", "down_n", "down_k", "down_warps", "down_unroll")
UP_FIELDS = ("up_n", "up_k", "up_warps", "up_unroll")


def tiles_of(up: tuple, down: tuple):
    from xinfer_cuda.kernels.moe import SlotTiles

    return SlotTiles(**dict(zip(UP_FIELDS, up)), **dict(zip(DOWN_FIELDS, down)))


class Case:
    """One layer's experts and ``routings`` steps of ``tokens`` tokens to run through them."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, top_k: int, tokens: int, routings: int, seed: int = 0):
        experts, hidden, inter = w2.shape
        generator = torch.Generator().manual_seed(seed)
        self.w13, self.w2, self.tokens = w13, w2, tokens
        self.steps = []
        for _ in range(routings):
            ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
            weights = torch.rand(tokens, top_k, generator=generator)
            x = torch.randn(tokens, hidden, generator=generator)
            self.steps.append((x.to(w2.device, w2.dtype), (weights / weights.sum(-1, keepdim=True)).to(w2.device),
                               ids.to(w2.device, torch.int32)))  # fmt: skip
        distinct = sum(ids.unique().numel() for _, _, ids in self.steps) / routings
        self.bytes = distinct * 3 * hidden * inter * w2.element_size()

    def reference(self) -> torch.Tensor:
        """The first routing through the torch reference in fp32, over only the experts it uses."""
        from xinfer.torch_ops import TorchOps

        x, weights, ids = self.steps[0]
        used, local = ids.long().unique(return_inverse=True)
        return TorchOps().fused_moe(x.float(), self.w13[used].float(), self.w2[used].float(), weights, local, "silu")

    def run(self, tiles) -> list[torch.Tensor]:
        from xinfer_cuda.kernels.moe import fused_moe

        return [fused_moe(x, self.w13, self.w2, weights, ids, "silu", tiles) for x, weights, ids in self.steps]


def time_calls(case: Case, tiles, smoke: bool) -> float:
    """Microseconds per call."""
    if smoke:
        start = time.perf_counter()
        case.run(tiles)
        return (time.perf_counter() - start) * 1e6 / len(case.steps)
    import triton.testing

    case.run(tiles)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        case.run(tiles)
    ms = triton.testing.do_bench(graph.replay, warmup=5, rep=40, return_mode="median")
    return ms * 1e3 / len(case.steps)


def measure(case: Case, name: str, label: str, tiles, expected: torch.Tensor, bandwidth: float,
            smoke: bool) -> dict | None:  # fmt: skip
    """One line; a variant that fails (to compile, say) is a line with its error, and the sweep goes on."""
    result = {"shape": name, "tokens": case.tokens, "variant": label, "tiles": asdict(tiles) if tiles else None}
    try:
        got = case.run(tiles)[0].float()
        error = ((got - expected).norm() / expected.norm()).item()
        us = time_calls(case, tiles, smoke)
    except Exception as failure:  # noqa: BLE001 - one variant's failure is a result of the sweep
        print(json.dumps({**result, "failed": f"{type(failure).__name__}: {failure}"[:300]}), flush=True)
        return None
    rate = case.bytes / (us * 1e-6)
    result.update(us=round(us, 2), GBps=round(rate / 1e9, 1), fraction=round(rate / bandwidth, 3),
                  error=float(f"{error:.2e}"), ok=error <= TOLERANCE)  # fmt: skip
    print(json.dumps(result), flush=True)
    return result


def experts(shape: tuple, smoke: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2I, H] and w2 [E, H, I], random at the scale of a trained layer's."""
    num_experts, hidden, inter, _ = shape
    dtype, device = (torch.float32, "cpu") if smoke else (torch.bfloat16, "cuda")
    generator = torch.Generator(device).manual_seed(0)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=generator, device=device, dtype=dtype) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=generator, device=device, dtype=dtype) * inter**-0.5
    return w13, w2


def sweep(name: str, w13: torch.Tensor, w2: torch.Tensor, top_k: int, tokens: int, bandwidth: float,
          smoke: bool) -> None:  # fmt: skip
    from xinfer_cuda.kernels.moe import SlotTiles

    case = Case(w13, w2, top_k, tokens, 2 if smoke else ROUTINGS)
    expected = case.reference()
    measure(case, name, "default", None, expected, bandwidth, smoke)
    # the first kernels' tiles (down's 8 rows: 64 // k, since k = 8 in both shapes)
    first = SlotTiles(up_n=32, up_k=128, down_n=8, down_k=128, pipelined=False)
    measure(case, name, "first", first, expected, bandwidth, smoke)
    down_variants, up_variants = (DOWN[::3], UP[::4]) if smoke else (DOWN, UP)
    results = [
        measure(case, name, "down j{} split{} {}x{} w{} unroll{}".format(*d), tiles_of(FIRST_UP, d), expected,
                bandwidth, smoke)
        for d in down_variants
    ]  # fmt: skip
    best_down = min((r for r in results if r and r["ok"]), key=lambda r: r["us"])["tiles"]
    down = tuple(best_down[field] for field in DOWN_FIELDS)
    results += [
        measure(case, name, "up {}x{} w{} unroll{}".format(*u), tiles_of(u, down), expected, bandwidth, smoke)
        for u in up_variants
        if u != FIRST_UP
    ]
    # round 3: gate/up and down in one launch (the start-up measurement's fused candidates)
    from xinfer_cuda.kernels.moe import slot_candidates

    fused = [t for t in slot_candidates(tokens, top_k, w13[0, :tokens]) if t.fused] or [
        SlotTiles(up_n=16, up_k=32, down_n=32, down_k=32, fused=True)  # (the interpreter's)
    ]
    results += [
        measure(case, name, f"fused up {t.up_n}x{t.up_k} w{t.up_warps} unroll{t.up_unroll} h{t.down_n}", t, expected,
                bandwidth, smoke)
        for t in fused
    ]  # fmt: skip
    best = min((r for r in results if r and r["ok"]), key=lambda r: r["us"])
    print(json.dumps({**best, "best": True}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU, Triton interpreter (times meaningless)")
    args = parser.parse_args()
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":  # the interpreter is chosen when triton is imported
            os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "TRITON_INTERPRET": "1"})
        shapes, token_counts, bandwidth = SMOKE_SHAPES, [1, 3], float("nan")
    else:
        from bandwidth import copy_bandwidth

        shapes, token_counts, bandwidth = {s: SHAPES[s] for s in args.shapes}, args.tokens, copy_bandwidth()
        print(json.dumps({"copy_bandwidth_TBps": round(bandwidth / 1e12, 3)}), flush=True)
    for name, shape in shapes.items():
        w13, w2 = experts(shape, args.smoke)
        for tokens in token_counts:
            sweep(name, w13, w2, shape[3], tokens, bandwidth, args.smoke)
        del w13, w2


if __name__ == "__main__":
    main()

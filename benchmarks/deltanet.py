"""The Gated DeltaNet kernels (xinfer_qwen.kernels) at Qwen3.6-35B-A3B's shapes, beside
flash-linear-attention's (``fla-core``) where it imports; a JSON line of ours, then one with fla's.

    python benchmarks/deltanet.py            # on the GPU
    python benchmarks/deltanet.py --sweep    # also our delta-rule kernels at each Dv tile (16, 32, 64), the conv at
                                             # each row tile (8 to 64)
    python benchmarks/deltanet.py --smoke    # tiny shapes, CPU, Triton interpreter (checks the script)

Shapes: 16 key heads and 32 value heads of 128 (bf16; the state fp32), the conv over q, k and
v (8192 channels, width 4); decode steps of 1, 64 and 256 sequences (each continuing from its
slot) and a prefill step of 8 prompts of 2048 tokens (starting).

"Ours" is our Triton kernels alone (fla's prefill switched off in xinfer_qwen.kernels.fla_prefill).
Where fla imports, a prefill case also runs the op as the server dispatches it (``op_us``: fla's
chunked kernels behind our adapter, gathering the slots' states and writing them back), replayed
from a CUDA graph as the server's prompt steps are (``op_failure`` if that cannot be captured).

Each case checks the outputs and final states against the torch reference
(xinfer_qwen.deltanet_ops) (relative errors: the norm of the difference over the norm of the
reference), then times them with ``triton.testing.do_bench`` (median, the L2 flushed before each
run), replaying a CUDA graph of the call. Every case of ours runs and is printed before any fla
call, so that a failing fla call cannot lose our figures; then fla's on the same inputs (errors
against the reference and against ours), replaying a CUDA graph of its decode where it can be
captured or calling it eagerly (its prefill, which prepares its chunk indices on the host;
``fla_graph`` says which). Each fla call is synchronized on its own, so an asynchronous CUDA error
is reported as ``fla_failure`` naming the call (and ends fla's part: the CUDA context is lost).
A decode step is bound by the state's bandwidth: ``GBps`` counts a read and a write of the
Hv x Dk x Dv x 4 bytes of every sequence's state.

fla 0.6.0's decode is ``fused_recurrent_gated_delta_rule(q, k, v, g, gk, gv, beta, ...)`` (it returns
the final state as a new tensor instead of writing it to the slot), its prefill
``chunk_gated_delta_rule(q, k, v, g, beta, ...)``: both take [1, T, H, D] contiguous rows, value heads a
multiple of the key heads, an int64 ``cu_seqlens``, an initial state [N, Hv, Dk, Dv] in fp32, and
are called with keywords only (the two orders differ: ``beta`` passed fifth is the decode's ``gk``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:  # before anything imports triton
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from xinfer import ops  # noqa: E402
from xinfer.ops import AttentionMetadata  # noqa: E402
from xinfer_cuda.ops import CudaOps  # noqa: E402
from xinfer_qwen import deltanet_ops  # noqa: E402
from xinfer_qwen.kernels import conv1d, delta_rule, fla_prefill  # noqa: E402

try:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
except ImportError:
    chunk_gated_delta_rule = fused_recurrent_gated_delta_rule = None

FULL = dict(k_heads=16, v_heads=32, dim=128, width=4, decode_batches=(1, 64, 256), prompts=8, prompt_len=2048)
TINY = dict(k_heads=2, v_heads=4, dim=16, width=4, decode_batches=(1, 3), prompts=2, prompt_len=70)


def metadata(q_lens: list[int], seq_lens: list[int], device: torch.device) -> AttentionMetadata:
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    n = len(q_lens)
    return AttentionMetadata(
        cu, torch.tensor(seq_lens, dtype=torch.int32, device=device), torch.zeros(n, 1, dtype=torch.int32, device=device),
        torch.zeros(int(cu[-1]), dtype=torch.int64, device=device), max(q_lens), max(seq_lens),
    )  # fmt: skip


def inputs(seqs: int, q_len: int, shape: dict, device: torch.device, dtype: torch.dtype) -> dict:
    generator = torch.Generator(device=device).manual_seed(seqs * 1000 + q_len)
    tokens, hk, hv, d = seqs * q_len, shape["k_heads"], shape["v_heads"], shape["dim"]

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=generator, device=device) * scale).to(dtype)

    channels = (2 * hk + hv) * d
    # the gates' inputs as the layer has them (a and b columns of its projection), and the decays and write
    # strengths they give (fla's inputs): log decays of a few tenths
    projected = randn(tokens, 2 * hv)
    gates = (projected[:, hv:], projected[:, :hv], randn(hv, scale=0.5) - 1.5, randn(hv))
    g, beta = deltanet_ops.gates(*gates)
    return dict(
        q=randn(tokens, hk, d), k=randn(tokens, hk, d), v=randn(tokens, hv, d), gates=gates, g=g, beta=beta.to(dtype),
        state=torch.randn(seqs, hv, d, d, generator=generator, device=device) * 0.05,
        x=randn(tokens, channels), weight=randn(channels, shape["width"], scale=0.5),
        conv_state=randn(seqs, channels, shape["width"] - 1),
        slots=torch.arange(seqs, dtype=torch.int32, device=device),
    )  # fmt: skip


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.double() - expected.double()).norm() / expected.double().norm()).item()


def seconds(fn, device: torch.device, graph: bool = True) -> float:
    """Seconds per call: of a CUDA graph's replays with ``graph``, else of eager calls."""
    fn()
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    import triton.testing

    torch.cuda.synchronize()
    if not graph:
        return triton.testing.do_bench(fn, return_mode="median") * 1e-3
    captured = torch.cuda.CUDAGraph()
    with torch.cuda.graph(captured):
        fn()
    return triton.testing.do_bench(captured.replay, return_mode="median") * 1e-3


class FlaFailure(Exception):
    """A failing fla call, named."""


def fla_call(what: str, fn):
    """``fn()``, synchronized so that an asynchronous CUDA error surfaces here, named by ``what``."""
    try:
        result = fn()
        torch.cuda.synchronize()
        return result
    except Exception as error:  # any failure of fla's ends its part, named
        raise FlaFailure(f"{what}: {type(error).__name__}: {error}"[:500]) from error


def fla_seconds(fn, decode: bool) -> tuple[float, bool]:
    """fla's seconds per call, and whether they are a CUDA graph's (its decode, if it can be captured)."""
    if decode:
        try:
            return seconds(fn, torch.device("cuda")), True
        except RuntimeError:  # a host sync in the call: time it eagerly
            torch.cuda.synchronize()
    return seconds(fn, torch.device("cuda"), graph=False), False


def fla_delta_rule(t: dict, meta: AttentionMetadata, initial_state: torch.Tensor | None, decode: bool):
    """fla's output and final state on the same inputs, as one varlen batch."""
    rule = fused_recurrent_gated_delta_rule if decode else chunk_gated_delta_rule
    host_lens = {} if decode else dict(cu_seqlens_cpu=meta.cu_seqlens_q.long().cpu())  # (the chunk's only)
    return rule(
        q=t["q"][None], k=t["k"][None], v=t["v"][None], g=t["g"][None], beta=t["beta"][None],
        scale=t["q"].shape[-1] ** -0.5, initial_state=initial_state, output_final_state=True,
        cu_seqlens=meta.cu_seqlens_q.long(), use_qk_l2norm_in_kernel=True, **host_lens,
    )  # fmt: skip


@contextlib.contextmanager
def ours_only():
    """Our Triton kernels for every step, fla's prefill switched off."""
    chunk_rule, fla_prefill.chunk_rule = fla_prefill.chunk_rule, None
    try:
        yield
    finally:
        fla_prefill.chunk_rule = chunk_rule


def op_through_fla(t: dict, meta: AttentionMetadata, expected: torch.Tensor, expected_state: torch.Tensor) -> dict:
    """The op as dispatched to fla's prefill (behind our adapter): its errors, and its time replayed from a CUDA graph."""
    try:
        state = t["state"].clone()
        args = (t["q"], t["k"], t["v"], *t["gates"])
        out = fla_call("op through fla", lambda: delta_rule.gated_delta_rule(*args, state, meta, t["slots"]))
        figures = dict(op_error=relative_error(out, expected), op_state_error=relative_error(state, expected_state))
        s = fla_call("op through fla, graphed", lambda: seconds(lambda: delta_rule.gated_delta_rule(*args, state, meta, t["slots"]), torch.device("cuda")))  # fmt: skip
        return dict(figures, op_us=s * 1e6, op_tokens_per_s=t["v"].shape[0] / s)
    except FlaFailure as failure:
        return dict(op_failure=str(failure))


def case(
    name: str, seqs: int, q_len: int, context: int, shape: dict, device: torch.device, dtype: torch.dtype, sweep: bool
) -> tuple[dict, dict]:
    """Our figures of one case, and what fla's comparison needs."""
    t = inputs(seqs, q_len, shape, device, dtype)
    meta = metadata([q_len] * seqs, [context] * seqs, device)
    decode = q_len == 1
    # correctness against the reference (on copies of the states)
    expected_state = t["state"].clone()
    expected = deltanet_ops.gated_delta_rule(t["q"], t["k"], t["v"], *t["gates"], expected_state, meta, t["slots"])
    state = t["state"].clone()
    with ours_only():
        ours = delta_rule.gated_delta_rule(t["q"], t["k"], t["v"], *t["gates"], state, meta, t["slots"])
    expected_conv_state = t["conv_state"].clone()
    expected_conv = deltanet_ops.causal_conv1d(t["x"], t["weight"], None, expected_conv_state, meta, t["slots"])
    conv_state = t["conv_state"].clone()
    conv = conv1d.causal_conv1d(t["x"], t["weight"], None, conv_state, meta, t["slots"])
    result = dict(
        case=name, seqs=seqs, q_len=q_len,
        error=relative_error(ours, expected), state_error=relative_error(state, expected_state),
        conv_error=relative_error(conv, expected_conv), conv_state_error=relative_error(conv_state, expected_conv_state),
    )  # fmt: skip

    state_bytes = seqs * shape["v_heads"] * shape["dim"] ** 2 * 4 * 2  # read and written once
    with ours_only():
        s = seconds(lambda: delta_rule.gated_delta_rule(t["q"], t["k"], t["v"], *t["gates"], state, meta, t["slots"]), device)  # fmt: skip
    result.update(us=s * 1e6, tokens_per_s=seqs * q_len / s)
    if decode:
        result["GBps"] = state_bytes / s / 1e9
    s = seconds(lambda: conv1d.causal_conv1d(t["x"], t["weight"], None, conv_state, meta, t["slots"]), device)
    result["conv_us"] = s * 1e6
    if sweep:  # the delta-rule kernel's Dv tile, and the conv's row tile: time (and error) at each
        with ours_only():
            result.update(sweep_tiles(t, meta, decode, expected, device))
        chosen = conv1d.MAX_BLOCK_T
        for block_t in (8, 16, 32, 64):
            conv1d.MAX_BLOCK_T = block_t
            s = seconds(lambda: conv1d.causal_conv1d(t["x"], t["weight"], None, conv_state, meta, t["slots"]), device)
            result[f"conv MAX_BLOCK_T={block_t}"] = dict(us=s * 1e6)
        conv1d.MAX_BLOCK_T = chosen

    return result, dict(t=t, meta=meta, decode=decode, initial=t["state"] if context > q_len else None,
                        expected=expected, expected_state=expected_state, ours=ours, state_bytes=state_bytes)  # fmt: skip


def sweep_tiles(t: dict, meta: AttentionMetadata, decode: bool, expected: torch.Tensor, device: torch.device) -> dict:
    """Our delta-rule kernel's time and error at each Dv tile."""
    result = {}
    tile = "RECURRENT_BLOCK_V" if decode else "CHUNK_BLOCK_V"
    chosen = getattr(delta_rule, tile)
    for block_v in (16, 32, 64):
        setattr(delta_rule, tile, block_v)
        swept = t["state"].clone()
        out = delta_rule.gated_delta_rule(t["q"], t["k"], t["v"], *t["gates"], swept, meta, t["slots"])
        s = seconds(lambda swept=swept: delta_rule.gated_delta_rule(t["q"], t["k"], t["v"], *t["gates"], swept, meta, t["slots"]), device)  # fmt: skip
        result[f"{tile}={block_v}"] = dict(us=s * 1e6, error=relative_error(out, expected))
    setattr(delta_rule, tile, chosen)
    return result


def fla_case(
    result: dict, t: dict, meta: AttentionMetadata, decode: bool, initial: torch.Tensor | None, expected: torch.Tensor,
    expected_state: torch.Tensor, ours: torch.Tensor, state_bytes: int,
) -> dict:  # fmt: skip
    """fla's figures on a case's inputs."""
    name, seqs, q_len = result["case"], result["seqs"], result["q_len"]
    fla_out, fla_state = fla_call(f"{name}: fla", lambda: fla_delta_rule(t, meta, initial, decode))
    errors = dict(fla_error=relative_error(fla_out[0], expected), fla_state_error=relative_error(fla_state, expected_state),
                  fla_vs_ours=relative_error(ours, fla_out[0]))  # fmt: skip
    s, graphed = fla_call(
        f"{name}: fla timed", lambda: fla_seconds(lambda: fla_delta_rule(t, meta, initial, decode), decode)
    )
    figures = dict(case=name, **errors, fla_us=s * 1e6, fla_graph=graphed, fla_tokens_per_s=seqs * q_len / s)
    if decode:
        figures["fla_GBps"] = state_bytes / s / 1e9
    if fla_prefill.wins(t["v"].device, t["v"].dtype, seqs * q_len, seqs, q_len):
        figures.update(op_through_fla(t, meta, expected, expected_state))
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under the Triton interpreter")
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="also time the delta-rule kernels at each Dv tile and the conv at each row tile",
    )
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("deltanet.py: no CUDA device (--smoke runs tiny shapes on the CPU)")
    device = torch.device("cpu" if args.smoke else "cuda")
    shape: dict = TINY if args.smoke else FULL
    dtype = torch.float16 if args.smoke else torch.bfloat16  # (the interpreter's dot mishandles bf16)
    prompts, prompt_len = shape["prompts"], shape["prompt_len"]
    steps = [(f"decode-{b}", b, 1, 100) for b in shape["decode_batches"]]
    steps.append((f"prefill-{prompts}x{prompt_len}", prompts, prompt_len, prompt_len))
    with ops.use(CudaOps()):  # the kernels join its launch chain (xinfer.kernel_api)
        cases = [case(*step, shape, device, dtype, args.sweep) for step in steps]
    summary = dict(benchmark="deltanet", device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                   dtype=str(dtype), fla=chunk_gated_delta_rule is not None, shape=shape, cases=[r for r, _ in cases])  # fmt: skip
    print(json.dumps(summary), flush=True)
    if chunk_gated_delta_rule is None or device.type != "cuda":
        return
    fla_cases = []
    try:
        with ops.use(CudaOps()):
            for result, data in cases:
                fla_cases.append(fla_case(result, **data))
    except FlaFailure as failure:
        fla_cases.append(dict(fla_failure=str(failure)))
    print(json.dumps(dict(benchmark="deltanet-fla", cases=fla_cases)), flush=True)


if __name__ == "__main__":
    main()

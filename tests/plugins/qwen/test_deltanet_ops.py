"""The Gated DeltaNet ops (xinfer_qwen.deltanet_ops) against transformers' torch functions of
qwen3_next (fp32): the conv against ``causal_conv1d_fn`` (a sequence that starts) and
``causal_conv1d_update`` (one that continues from its state), the delta rule against
``torch_recurrent_gated_delta_rule`` and ``torch_chunk_gated_delta_rule``, the gated norm against
``Qwen3_5RMSNormGated``; batches of
several sequences of different lengths, some starting and some continuing, in slots out of
order, with a padding sequence.

transformers binds those names to flash-linear-attention's or causal-conv1d's kernels when
they import (CUDA only); the tests unwrap them to its own torch functions, whatever is installed."""

from __future__ import annotations

import inspect
import os
from dataclasses import replace
from itertools import pairwise

import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from xinfer.ops import AttentionMetadata
from xinfer_cuda.kernels import arrivals
from xinfer_qwen import deltanet_ops
from xinfer_qwen.kernels import conv1d, delta_rule, fla_prefill, gated_norm

DEVICE = torch.device(os.environ["XINFER_KERNEL_DEVICE"])
pytestmark = pytest.mark.usefixtures("cuda_backend")


def hf_torch_function(name: str):
    """transformers' own torch function ``name`` of qwen3_next, under the wrappers that dispatch to installed kernels."""
    function = inspect.unwrap(getattr(hf, name))
    assert function.__module__ == hf.__name__, f"{name} unwraps to {function.__module__}.{function.__qualname__}"
    return function


causal_conv1d_fn = hf_torch_function("causal_conv1d_fn")
causal_conv1d_update = hf_torch_function("causal_conv1d_update")
HF_RULES = {
    "recurrent": hf_torch_function("torch_recurrent_gated_delta_rule"),
    "chunk": hf_torch_function("torch_chunk_gated_delta_rule"),
}

# (tokens this step, tokens before it) per sequence: starting (0 before; one with fewer rows
# than the conv's K-1), continuing with a long and a short step, decode steps, and a padding
# sequence (0, 0)
BATCH = [(37, 0), (1, 5), (2, 9), (0, 0), (70, 0), (1, 1), (9, 40), (2, 0)]
SLOTS = [3, 0, 6, 1, 2, 7, 5, 4]


def metadata(q_lens: list[int], before: list[int]) -> AttentionMetadata:
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([q + b for q, b in zip(q_lens, before)], dtype=torch.int32)
    blocks = torch.zeros(len(q_lens), 1, dtype=torch.int32)
    return AttentionMetadata(cu, seq_lens, blocks, torch.zeros(int(cu[-1]), dtype=torch.int64), max(q_lens), 1)


def batch_metadata(batch=BATCH) -> AttentionMetadata:
    return metadata([q for q, _ in batch], [b for _, b in batch])


def random_state(shape, generator, slots=SLOTS, batch=BATCH) -> torch.Tensor:
    """Random state in every slot, NaN in the slots of sequences that start (never read)."""
    state = torch.randn(shape, generator=generator)
    for slot, (q_len, before) in zip(slots, batch):
        if before == 0 and q_len > 0:
            state[slot] = float("nan")
    return state


def conv_inputs(generator, channels=24, width=4):
    tokens = sum(q for q, _ in BATCH)
    x = torch.randn(tokens, channels, generator=generator)
    weight = torch.randn(channels, width, generator=generator) / 2
    bias = torch.randn(channels, generator=generator)
    state = random_state((8, channels, width - 1), generator)
    return x, weight, bias, state


@pytest.mark.parametrize("activation", ["silu", None, "gelu_new", "relu2"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_causal_conv1d_matches_hf(activation, with_bias):
    generator = torch.Generator().manual_seed(0)
    x, weight, bias, state = conv_inputs(generator)
    bias = bias if with_bias else None
    meta, slots = batch_metadata(), torch.tensor(SLOTS, dtype=torch.int32)
    expected_state = state.clone()
    out = deltanet_ops.causal_conv1d(x, weight, bias, state, meta, slots, activation)
    start = 0
    for slot, (q_len, before) in zip(SLOTS, BATCH):
        if q_len == 0:
            continue
        rows = x[start : start + q_len].T[None]  # [1, C, q_len] as HF lays it out
        conv_state = expected_state[slot][None].clone() if before else torch.zeros_like(expected_state[slot][None])
        updated = causal_conv1d_update(rows, conv_state, weight, bias, activation)
        expected = updated if before else causal_conv1d_fn(rows, weight, bias, activation)
        expected_state[slot] = conv_state[0]
        torch.testing.assert_close(out[start : start + q_len], expected[0].T, rtol=1e-5, atol=1e-5)
        start += q_len
    torch.testing.assert_close(state, expected_state, rtol=0, atol=0, equal_nan=True)  # the padding's slot untouched


def test_causal_conv1d_continued_equals_one_call():
    generator = torch.Generator().manual_seed(1)
    x, weight, bias, _ = conv_inputs(generator)
    x = x[:23]
    state = torch.full((2, x.shape[1], weight.shape[1] - 1), float("nan"))
    slots = torch.tensor([1], dtype=torch.int32)
    whole = deltanet_ops.causal_conv1d(x, weight, bias, state.clone(), metadata([23], [0]), slots)
    parts, done = [], 0
    for q_len in (7, 1, 2, 13):  # a step shorter than the window shifts older state in
        parts.append(deltanet_ops.causal_conv1d(x[done : done + q_len], weight, bias, state, metadata([q_len], [done]), slots))  # fmt: skip
        done += q_len
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state[1], x[-3:].T)


def delta_inputs(generator, batch=BATCH, k_heads=2, v_heads=4, dk=16, dv=8, slots=8):
    tokens = sum(q for q, _ in batch)
    q = torch.randn(tokens, k_heads, dk, generator=generator)
    k = torch.randn(tokens, k_heads, dk, generator=generator)
    v = torch.randn(tokens, v_heads, dv, generator=generator)
    g = -torch.rand(tokens, v_heads, generator=generator) * 2  # log decays in (-2, 0]
    beta = torch.rand(tokens, v_heads, generator=generator)
    state = random_state((slots, v_heads, dk, dv), generator, SLOTS[: len(batch)], batch) / dk**0.5
    return q, k, v, g, beta, state


@pytest.mark.parametrize("hf_rule", ["recurrent", "chunk"])
@pytest.mark.parametrize("heads", [(2, 4), (3, 3)], ids=["gqa", "mha"])
def test_gated_delta_rule_matches_hf(hf_rule, heads):
    generator = torch.Generator().manual_seed(2)
    q, k, v, g, beta, state = delta_inputs(generator, k_heads=heads[0], v_heads=heads[1])
    expected_state = state.clone()
    out = deltanet_ops.delta_rule(q, k, v, g, beta, state, batch_metadata(), torch.tensor(SLOTS, dtype=torch.int32))
    rule = HF_RULES[hf_rule]
    start = 0
    for slot, (q_len, before) in zip(SLOTS, BATCH):
        if q_len == 0:
            continue
        rows = slice(start, start + q_len)
        initial = None if before == 0 else expected_state[slot][None]
        # value heads share a query/key head in groups of consecutive heads; transformers 5.17 (the GPU machine's) wants q/k
        # repeated to the value heads already (its model did that), later ones repeat them alike inside the rule
        group = v.shape[1] // q.shape[1]
        q_rows, k_rows = (t[rows].repeat_interleave(group, dim=1)[None] for t in (q, k))
        expected, final = rule(
            q_rows, k_rows, v[rows][None], g[rows][None], beta[rows][None],
            initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        expected_state[slot] = final[0]
        torch.testing.assert_close(out[rows], expected[0], rtol=1e-4, atol=1e-5)
        start += q_len
    torch.testing.assert_close(state, expected_state, rtol=1e-4, atol=1e-5, equal_nan=True)


def test_gated_delta_rule_continued_equals_one_call():
    generator = torch.Generator().manual_seed(3)
    q, k, v, g, beta, _ = delta_inputs(generator, batch=[(30, 0)])
    state = torch.full((2, 4, 16, 8), float("nan"))
    slots = torch.tensor([1], dtype=torch.int32)
    whole_state = state.clone()
    whole = deltanet_ops.delta_rule(q, k, v, g, beta, whole_state, metadata([30], [0]), slots)
    parts, done = [], 0
    for q_len in (11, 1, 18):
        rows = slice(done, done + q_len)
        parts.append(deltanet_ops.delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], state, metadata([q_len], [done]), slots))  # fmt: skip
        done += q_len
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state[1], whole_state[1], rtol=1e-5, atol=1e-6)


def test_unknown_activation_is_one_clear_error():
    x, weight, bias, state = conv_inputs(torch.Generator().manual_seed(4))
    with pytest.raises(ValueError, match="unknown activation 'entmax'"):
        deltanet_ops.causal_conv1d(x, weight, bias, state, batch_metadata(), torch.tensor(SLOTS), "entmax")


# The kernels against the references

ON_GPU = DEVICE.type == "cuda"
TOL = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
# the interpreter's tl.dot mishandles bf16 operands (so test_moe_kernels leaves bf16 to the GPU too)
DOT_DTYPES = [torch.float32, torch.float16, torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]


def assert_close_on_rows(got: torch.Tensor, expected: torch.Tensor, meta: AttentionMetadata, tol: float):
    """Relative error over the rows of the step's sequences (the kernels leave others unwritten)."""
    owned = torch.cat([torch.arange(lo, hi) for lo, hi in pairwise(meta.cu_seqlens_q.tolist())])
    got, expected = got.cpu().double()[owned], expected.double()[owned]
    error = (got - expected).norm() / expected.norm()
    assert error <= tol, f"relative error {error:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("width, channels", [(4, 200), (2, 24)])
def test_conv1d_kernel_matches_the_reference(dtype, width, channels):
    generator = torch.Generator().manual_seed(width)
    tokens = sum(q for q, _ in BATCH)
    wide = torch.randn(tokens, channels + 16, generator=generator).to(dtype)
    x = wide[:, 8 : 8 + channels]  # a view with a row stride, as the layer's projections give
    weight = (torch.randn(channels, width, generator=generator) / 2).to(dtype)
    some_bias = torch.randn(channels, generator=generator).to(dtype)
    state = random_state((8, channels, width - 1), generator).to(dtype)
    meta, slots = batch_metadata(), torch.tensor(SLOTS, dtype=torch.int32)
    for bias, activation in [(some_bias, "silu"), (None, None)]:
        expected_state, got_state = state.clone(), state.to(DEVICE)
        expected = deltanet_ops.causal_conv1d(x, weight, bias, expected_state, meta, slots, activation)
        got = conv1d.causal_conv1d(
            x.to(DEVICE), weight.to(DEVICE), None if bias is None else bias.to(DEVICE), got_state,
            to_device(meta, DEVICE), slots.to(DEVICE), activation,
        )  # fmt: skip
        assert got.dtype == dtype
        assert_close_on_rows(got, expected, meta, TOL[dtype])
        torch.testing.assert_close(got_state.cpu(), expected_state, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_conv1d_kernel_over_more_sequences_than_one_search(dtype, monkeypatch):
    """A batch of more sequences than the kernel's tile search reads at once (made 16 here, to
    keep the interpreter quick), decode rows between prompts of several tiles, some continuing:
    every row and slot against the reference. The state in fp32 whatever the inputs' dtype, as
    the layer keeps it."""
    monkeypatch.setattr(conv1d, "SEARCH", 16)
    generator = torch.Generator().manual_seed(7)
    count = 2 * conv1d.SEARCH + 7
    q_lens = torch.tensor([1, 1, 2, 40, 1, 3, 70, 1])[torch.randint(8, (count,), generator=generator)].tolist()
    before = torch.randint(0, 3, (count,), generator=generator).mul(5).tolist()  # 0: the sequence starts
    channels, width = 24, 4
    x = torch.randn(sum(q_lens), channels, generator=generator).to(dtype)
    weight = (torch.randn(channels, width, generator=generator) / 2).to(dtype)
    slots = torch.randperm(count + 3, generator=generator)[:count].to(torch.int32)
    state = torch.randn(count + 3, channels, width - 1, generator=generator)
    meta = metadata(q_lens, before)
    expected_state, got_state = state.clone(), state.to(DEVICE)
    expected = deltanet_ops.causal_conv1d(x, weight, None, expected_state, meta, slots)
    got = conv1d.causal_conv1d(
        x.to(DEVICE), weight.to(DEVICE), None, got_state, to_device(meta, DEVICE), slots.to(DEVICE)
    )
    assert_close_on_rows(got, expected, meta, TOL[dtype])
    torch.testing.assert_close(got_state.cpu(), expected_state)


def to_device(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    return replace(meta, **{f: getattr(meta, f).to(device) for f in ("cu_seqlens_q", "seq_lens", "block_tables", "slot_mapping")})  # fmt: skip


DECODE = [(1, 5), (1, 0), (0, 0), (1, 63), (1, 64)]
# (name, batch, key heads, value heads, Dk, Dv)
DELTA_CASES = [
    ("decode", DECODE, 2, 4, 16, 8),
    ("mixed", BATCH, 2, 4, 16, 8),
    ("long", [(130, 0), (1, 7), (65, 64)], 1, 1, 32, 16),
    ("heads-128", [(70, 0), (1, 9)], 1, 2, 128, 128),
]


def step_inputs(case, dtype):
    """A step's q, k and v (views of the conv's output), its projection (``a`` and ``b`` columns of
    it, ``z`` too), A_log, dt_bias, the state, the metadata and the slots."""
    _, batch, k_heads, v_heads, dk, dv = case
    generator = torch.Generator().manual_seed(len(batch))
    slots = SLOTS[: len(batch)]
    tokens = sum(q for q, _ in batch)
    mixed = torch.randn(tokens, (2 * k_heads * dk + v_heads * dv), generator=generator).to(dtype)
    q, k, v = mixed.split([k_heads * dk, k_heads * dk, v_heads * dv], dim=1)
    q, k, v = q.view(tokens, k_heads, dk), k.view(tokens, k_heads, dk), v.view(tokens, v_heads, dv)
    # z | b | a, b and a past softplus' 20 too
    projected = (torch.randn(tokens, v_heads * dv + 2 * v_heads + 3, generator=generator) * 3).to(dtype)
    A_log = (torch.randn(v_heads, generator=generator) / 2).to(dtype)
    dt_bias = torch.randn(v_heads, generator=generator).to(dtype)
    state = random_state((8, v_heads, dk, dv), generator, slots, batch) / dk**0.5
    meta, slot_tensor = metadata([q for q, _ in batch], [b for _, b in batch]), torch.tensor(slots, dtype=torch.int32)
    return (q, k, v), projected, A_log, dt_bias, state, meta, slot_tensor


def split_projection(projected: torch.Tensor, v_heads: int, dv: int) -> tuple[torch.Tensor, ...]:
    """``z`` [T, Hv, Dv], ``b`` and ``a`` [T, Hv]: views of the projection, as the layer splits it."""
    z = projected[:, 1 : 1 + v_heads * dv].unflatten(-1, (v_heads, dv))
    b = projected[:, 1 + v_heads * dv : 1 + v_heads * dv + v_heads]
    return z, b, projected[:, 1 + v_heads * dv + v_heads : 1 + v_heads * dv + 2 * v_heads]


def assert_state_close(got_state: torch.Tensor, expected_state: torch.Tensor, tol: float) -> None:
    error = (got_state.cpu() - expected_state).nan_to_num().norm() / expected_state.nan_to_num().norm()
    assert error <= tol, f"state: relative error {error:.2e}"
    assert got_state.cpu().isnan().equal(expected_state.isnan())  # slots of no sequence untouched


@pytest.mark.parametrize("dtype", DOT_DTYPES, ids=str)
@pytest.mark.parametrize("case", DELTA_CASES, ids=lambda c: c[0])
def test_gated_delta_rule_kernel_matches_the_reference(case, dtype):
    """The op with its gates: decode steps through the recurrent kernel (the gates computed in
    it), others through the gates' kernel and the chunked form."""
    v_heads, dv = case[3], case[5]
    (q, k, v), projected, A_log, dt_bias, state, meta, slots = step_inputs(case, dtype)
    _, b, a = split_projection(projected, v_heads, dv)
    expected_state, got_state = state.clone(), state.to(DEVICE)
    expected = deltanet_ops.gated_delta_rule(q, k, v, a, b, A_log, dt_bias, expected_state, meta, slots)
    _, device_b, device_a = split_projection(projected.to(DEVICE), v_heads, dv)  # (views of it, as the layer's)
    got = delta_rule.gated_delta_rule(
        *(t.to(DEVICE) for t in (q, k, v)), device_a, device_b, A_log.to(DEVICE), dt_bias.to(DEVICE), got_state,
        to_device(meta, DEVICE), slots.to(DEVICE),
    )  # fmt: skip
    assert got.dtype == dtype and got.shape == v.shape
    assert_close_on_rows(got, expected, meta, TOL[dtype])
    assert_state_close(got_state, expected_state, TOL[dtype])


@pytest.mark.parametrize("dtype", DOT_DTYPES, ids=str)
# decode over heads of three Dv tiles (the last of the three to finish normalizes), then a mixed step
@pytest.mark.parametrize("case", [("decode-tiles", [(1, 5), (1, 0), (0, 0), (1, 9)], 1, 2, 32, 96), DELTA_CASES[1]],
                         ids=lambda c: c[0])  # fmt: skip
def test_gated_delta_rule_norm_matches_the_reference(case, dtype):
    """The rule and the gated norm in one op: a decode step in the recurrent kernel, the last of a
    head's Dv tiles normalizing it (its counters left at zero for the next step); a step with
    prompts through the rule's kernels, then the norm's."""
    v_heads, dv = case[3], case[5]
    (q, k, v), projected, A_log, dt_bias, state, meta, slots = step_inputs(case, dtype)
    z, b, a = split_projection(projected, v_heads, dv)
    norm_weight = (1 + torch.randn(dv, generator=torch.Generator().manual_seed(11)) / 4).to(dtype)
    expected_state, got_state = state.clone(), state.to(DEVICE)
    expected = deltanet_ops.gated_delta_rule_norm(q, k, v, a, b, A_log, dt_bias, expected_state, meta, slots, z,
                                                  norm_weight, 1e-6)  # fmt: skip
    device_z, device_b, device_a = split_projection(projected.to(DEVICE), v_heads, dv)
    got = delta_rule.gated_delta_rule_norm(
        *(t.to(DEVICE) for t in (q, k, v)), device_a, device_b, A_log.to(DEVICE), dt_bias.to(DEVICE), got_state,
        to_device(meta, DEVICE), slots.to(DEVICE), device_z, norm_weight.to(DEVICE), 1e-6,
    )  # fmt: skip
    assert got.dtype == dtype and got.shape == (v.shape[0], v_heads * dv)
    assert_close_on_rows(got, expected, meta, TOL[dtype])
    assert_state_close(got_state, expected_state, TOL[dtype])
    assert not arrivals.counters(DEVICE, "gated_delta_rule_norm", 1).any()


def test_gates_kernel_matches_the_reference():
    """The prefill's gates (decode computes them in the recurrent kernel, checked above), over
    rows of a strided projection, at an odd head count, with inputs past softplus' threshold."""
    generator = torch.Generator().manual_seed(9)
    projected = torch.randn(37, 2 * 5 + 3, generator=generator) * 12
    b, a = projected[:, 1:6], projected[:, 6:11]
    A_log, dt_bias = torch.randn(5, generator=generator), torch.randn(5, generator=generator)
    expected = deltanet_ops.gates(a, b, A_log, dt_bias)
    got = delta_rule.gates(*(t.to(DEVICE) for t in (a, b, A_log, dt_bias)))
    for got_one, expected_one in zip(got, expected):
        torch.testing.assert_close(got_one.cpu(), expected_one, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gated_rms_norm_matches_hf(dtype):
    """The reference against transformers' ``Qwen3_5RMSNormGated`` (a random weight, fp32), and the
    kernel against the reference over strided views (``z`` columns of a projection), 5 heads of 24."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    generator = torch.Generator().manual_seed(10)
    tokens, heads, dim = 7, 5, 24
    x = torch.randn(tokens, heads, dim, generator=generator).to(dtype)
    z = (torch.randn(tokens, heads * dim + 9, generator=generator) * 2).to(dtype)[:, 4 : 4 + heads * dim]
    z = z.unflatten(-1, (heads, dim))
    weight = (1 + torch.randn(dim, generator=generator) / 4).to(dtype)
    expected = deltanet_ops.gated_rms_norm(x, z, weight, 1e-6)
    if dtype == torch.float32:
        hf_norm = Qwen3_5RMSNormGated(dim, eps=1e-6)
        hf_norm.weight.data.copy_(weight)
        torch.testing.assert_close(expected, hf_norm(x, z).flatten(1), rtol=1e-6, atol=1e-6)
    got = gated_norm.gated_rms_norm(x.to(DEVICE), z.to(DEVICE), weight.to(DEVICE), 1e-6)
    assert got.dtype == dtype and got.shape == (tokens, heads * dim)
    torch.testing.assert_close(got.cpu(), expected, **({} if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)))


# flash-linear-attention's chunked prefill behind the op (xinfer_qwen.kernels.fla_prefill)


def test_fla_chunk_indices_name_every_chunk_once_then_a_sequence_of_no_rows():
    q_lens = [130, 0, 1, 64, 65]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    tokens = sum(q_lens) + 7  # a padded step
    cu_seqlens, indices = fla_prefill.chunk_indices(cu, tokens)
    assert cu_seqlens.dtype == torch.int64 and cu_seqlens.tolist() == [*cu.tolist(), cu[-1].item()]
    real = [(n, t) for n, q in enumerate(q_lens) for t in range(-(-q // fla_prefill.CHUNK))]
    spare = [(len(q_lens), 0)] * (-(-tokens // fla_prefill.CHUNK) + len(q_lens) - len(real))
    assert [tuple(row) for row in indices.tolist()] == real + spare


def fla_contract(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_indices,
                 use_qk_l2norm_in_kernel):  # fmt: skip
    """fla's ``chunk_gated_delta_rule`` as xinfer calls it, from the torch reference: [1, T, ...]
    rows, sequence n over ``cu_seqlens[n]:cu_seqlens[n+1]`` starting from ``initial_state[n]``,
    returning the outputs and every sequence's final state (a sequence of no rows: its initial)."""
    assert use_qk_l2norm_in_kernel and output_final_state and scale == q.shape[-1] ** -0.5
    assert g.dtype == torch.float32 and initial_state.dtype == torch.float32
    assert chunk_indices.shape == (-(-q.shape[1] // fla_prefill.CHUNK) + len(cu_seqlens) - 2, 2)
    q_lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    meta = metadata(q_lens, [1] * len(q_lens))  # every sequence continues: from its initial state
    final = initial_state.clone()
    out = deltanet_ops.delta_rule(q[0], k[0], v[0], g[0], beta[0], final, meta, torch.arange(len(q_lens)))
    return out[None], final


def test_fla_adapter_reads_and_writes_the_slots(monkeypatch):
    """The adapter around fla (given the torch reference of fla's contract, so this runs on the
    CPU): sequences that start ignore their slot, continuing ones start from it, every sequence
    with rows writes its final state back, and padding sequences (slot 0, as a padded CUDA-graph
    step gives them, here also a real sequence's slot) write nothing."""
    monkeypatch.setattr(fla_prefill, "chunk_rule", fla_contract)
    batch = [(130, 0), (1, 7), (0, 0), (65, 64), (3, 0), (0, 0)]
    slots = [2, 0, 0, 5, 3, 0]
    generator = torch.Generator().manual_seed(11)
    tokens, k_heads, v_heads, dk, dv = sum(q for q, _ in batch) + 5, 1, 2, 16, 8
    q, k = torch.randn(2, tokens, k_heads, dk, generator=generator)
    v = torch.randn(tokens, v_heads, dv, generator=generator)
    g = -torch.rand(tokens, v_heads, generator=generator)
    beta = torch.rand(tokens, v_heads, generator=generator)
    state = random_state((8, v_heads, dk, dv), generator, slots, batch) / dk**0.5
    meta, slot_tensor = metadata([q for q, _ in batch], [b for _, b in batch]), torch.tensor(slots, dtype=torch.int32)
    expected_state, got_state = state.clone(), state.to(DEVICE)
    expected = deltanet_ops.delta_rule(q, k, v, g, beta, expected_state, meta, slot_tensor)
    got = fla_prefill.delta_rule(
        *(t.to(DEVICE) for t in (q, k, v, g, beta)), got_state, to_device(meta, DEVICE), slot_tensor.to(DEVICE)
    )
    assert_close_on_rows(got, expected, meta, TOL[torch.float32])
    torch.testing.assert_close(got_state.cpu(), expected_state, equal_nan=True)


def test_fla_goes_only_to_gpu_steps_with_a_chunk_of_rows_per_sequence(monkeypatch):
    monkeypatch.setattr(fla_prefill, "chunk_rule", fla_contract)
    cuda, cpu, bf16 = torch.device("cuda"), torch.device("cpu"), torch.bfloat16
    assert fla_prefill.wins(cuda, bf16, tokens=8 * 2048, num_seqs=8, max_seqlen_q=2048)
    assert fla_prefill.wins(cuda, torch.float16, tokens=8 * 2048, num_seqs=8, max_seqlen_q=2048)
    assert not fla_prefill.wins(cuda, bf16, tokens=2048, num_seqs=256, max_seqlen_q=2048)  # a bucket padded with seqs
    assert not fla_prefill.wins(cuda, bf16, tokens=256, num_seqs=256, max_seqlen_q=1)  # decode
    assert not fla_prefill.wins(cpu, bf16, tokens=8 * 2048, num_seqs=8, max_seqlen_q=2048)  # fla's kernels need a GPU
    assert not fla_prefill.wins(cuda, torch.float32, tokens=8 * 2048, num_seqs=8, max_seqlen_q=2048)  # exact products
    monkeypatch.setattr(fla_prefill, "chunk_rule", None)
    assert not fla_prefill.wins(cuda, bf16, tokens=8 * 2048, num_seqs=8, max_seqlen_q=2048)  # not installed


@pytest.mark.skipif(not (ON_GPU and fla_prefill.available()), reason="fla's kernels need a GPU and fla-core installed")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [c for c in DELTA_CASES if max(q for q, _ in c[1]) > 1], ids=lambda c: c[0])
def test_gated_delta_rule_through_fla_matches_the_reference(case, dtype, monkeypatch):
    """Every case with a prefill through fla's prefill (the op sends it only 16-bit prefill-heavy
    steps; decode-only steps stay with the recurrent kernel)."""
    monkeypatch.setattr(fla_prefill, "wins", lambda device, dtype, tokens, num_seqs, max_seqlen_q: max_seqlen_q > 1)
    test_gated_delta_rule_kernel_matches_the_reference(case, dtype)


@pytest.mark.skipif(not (ON_GPU and fla_prefill.available()), reason="fla's kernels need a GPU and fla-core installed")
def test_fla_prefill_replays_from_a_cuda_graph_with_other_lengths():
    """Captured once and replayed after the step's lengths changed in place, as the server's
    CUDA-graph steps are: the chunk indices are built on the device, so the replay follows the
    new lengths (fla's own, built on the host, would stay those of the capture)."""
    generator = torch.Generator().manual_seed(5)
    captured, replayed = [(130, 0), (70, 10), (60, 0)], [(1, 5), (200, 0), (59, 3)]
    tokens, k_heads, v_heads, dk, dv, slots = 264, 2, 4, 64, 64, torch.tensor([2, 0, 5], dtype=torch.int32)
    q, k = (torch.randn(tokens, k_heads, dk, generator=generator).bfloat16() for _ in range(2))
    v = torch.randn(tokens, v_heads, dv, generator=generator).bfloat16()
    g = -torch.rand(tokens, v_heads, generator=generator)
    beta = torch.rand(tokens, v_heads, generator=generator).bfloat16()
    state = torch.randn(6, v_heads, dk, dv, generator=generator) / dk**0.5
    inputs = [t.to(DEVICE) for t in (q, k, v, g, beta)]

    def step_metadata(batch):
        return to_device(metadata([q for q, _ in batch], [b for _, b in batch]), DEVICE)

    meta, device_state, device_slots = step_metadata(captured), state.to(DEVICE), slots.to(DEVICE)
    fla_prefill.delta_rule(*inputs, device_state.clone(), meta, device_slots)  # warm-up: fla's autotuning
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fla_prefill.delta_rule(*inputs, device_state, meta, device_slots)
    other = step_metadata(replayed)
    meta.cu_seqlens_q.copy_(other.cu_seqlens_q)
    meta.seq_lens.copy_(other.seq_lens)
    device_state.copy_(state.to(DEVICE))
    graph.replay()
    expected_state = state.clone()
    expected = deltanet_ops.delta_rule(q, k, v, g, beta, expected_state, other, slots)
    assert_close_on_rows(out, expected, other, TOL[torch.bfloat16])
    error = (device_state.cpu() - expected_state).norm() / expected_state.norm()
    assert error <= TOL[torch.bfloat16], f"state: relative error {error:.2e}"

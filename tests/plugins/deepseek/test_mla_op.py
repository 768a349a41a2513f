"""The multi-head latent attention op (``mla_attention``): its torch reference against a dense,
unpaged attention written with torch's ``scaled_dot_product_attention``, and the Triton kernels
against the reference on the device ``XINFER_KERNEL_DEVICE`` picks (tests/conftest.py; on "cpu"
under the Triton interpreter, tolerances as in tests/backends/test_cuda_kernels.py).

Steps are built from dense per-sequence contexts, scattered into a paged cache through
shuffled (non-contiguous) block tables; the slots no sequence owns and this step's slots
hold NaN before the op, so a read of an unwritten or foreign slot shows in the output."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from xinfer.ops import AttentionMetadata
from xinfer_deepseek.kernels import mla
from xinfer_deepseek.mla_ops import encode_fp8, fp8_row_bytes, mla_attention, mla_attention_fp8

pytestmark = pytest.mark.usefixtures("cuda_backend")


@dataclass
class Step:
    q_latent: Tensor  # [T, H, R]
    q_rope: Tensor  # [T, H, P]
    latent: Tensor  # [T, R + P]
    cache: Tensor  # [num_blocks, block_size, row width]
    meta: AttentionMetadata
    stored: list[Tensor]  # each sequence's rows as the cache holds them, this step's included
    contexts: list[Tensor]  # and as attention reads them [L, R + P]: dense (for fp8, dequantized)
    scale: float

    def args(self, device: torch.device | str = "cpu") -> tuple:
        """The op's arguments on ``device``, over a copy of the cache."""
        fields = ("cu_seqlens_q", "seq_lens", "block_tables", "slot_mapping")
        meta = replace(self.meta, **{name: getattr(self.meta, name).to(device) for name in fields})
        tensors = (self.q_latent, self.q_rope, self.latent, self.cache.clone())
        return (*(t.to(device) for t in tensors), meta, self.scale)


def paged_step(
    q_lens: list[int],
    context_lens: list[int],
    heads: int,
    rank: int,
    rope: int,
    dtype: torch.dtype = torch.float32,
    block_size: int = 16,
    pad_tokens: int = 0,
    pad_seqs: int = 0,
    seed: int = 0,
    fp8: bool = False,
) -> Step:
    """A step whose sequence ``b`` has ``q_lens[b]`` queries, the last of a context of
    ``context_lens[b]`` rows; the earlier rows already cached, this step's in ``latent``.
    ``pad_tokens`` rows of no sequence (slot -1) and ``pad_seqs`` sequences of no query
    and no context follow, as in a step padded to a captured shape. With ``fp8`` the
    cache holds fp8 rows, and 0xFF (NaN in e4m3, fp32 and bf16) where nothing was written."""
    generator = torch.Generator().manual_seed(seed)
    contexts = [torch.randn(n, rank + rope, generator=generator).to(dtype) for n in context_lens]
    stored = [encode_fp8(c, rank) for c in contexts] if fp8 else contexts
    width = stored[0].shape[-1]
    blocks_of = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_of) + 3  # a few blocks no sequence owns
    order = torch.randperm(num_blocks, generator=generator).tolist()
    max_blocks = max(blocks_of) + 1
    tables = torch.zeros(len(q_lens) + pad_seqs, max_blocks, dtype=torch.int32)
    for b, n in enumerate(blocks_of):
        tables[b, :n] = torch.tensor(order[sum(blocks_of[:b]) : sum(blocks_of[: b + 1])], dtype=torch.int32)

    if fp8:
        cache = torch.full((num_blocks, block_size, width), 0xFF, dtype=torch.uint8)
    else:
        cache = torch.full((num_blocks, block_size, width), float("nan"), dtype=dtype)
    slots, new_rows = [], []
    for b, (q_len, context) in enumerate(zip(q_lens, contexts)):
        positions = torch.arange(len(context))
        slot = tables[b, positions // block_size].long() * block_size + positions % block_size
        cached = len(context) - q_len
        cache.view(-1, width)[slot[:cached]] = stored[b][:cached]
        slots.append(slot[cached:])
        new_rows.append(context[cached:])
    slots.append(torch.full((pad_tokens,), -1))
    new_rows.append(torch.randn(pad_tokens, rank + rope, generator=generator).to(dtype))

    num_tokens = sum(q_lens) + pad_tokens
    cu_seqlens_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()] + [sum(q_lens)] * pad_seqs)
    meta = AttentionMetadata(
        cu_seqlens_q=cu_seqlens_q.to(torch.int32),
        seq_lens=torch.tensor(context_lens + [0] * pad_seqs, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.cat(slots).long(),
        max_seqlen_q=max(q_lens),
        max_seq_len=max(context_lens),
    )
    return Step(
        q_latent=torch.randn(num_tokens, heads, rank, generator=generator).to(dtype),
        q_rope=torch.randn(num_tokens, heads, rope, generator=generator).to(dtype),
        latent=torch.cat(new_rows),
        cache=cache,
        meta=meta,
        stored=stored,
        contexts=[dequantized(c, rank) for c in contexts] if fp8 else contexts,
        scale=(rank + rope) ** -0.5,
    )


def dequantized(rows: Tensor, rank: int) -> Tensor:
    """Rows [L, R + P] as an fp8 cache gives them back: the latent in e4m3 on its groups'
    absmax / 448 (groups of up to 128 values), the rope key in bf16."""
    groups = -(-rank // 128)
    latent = rows[:, :rank].float().unflatten(-1, (groups, -1))
    absmax = latent.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)  # (a zero group stays zero)
    latent = (latent * 448 / absmax).to(torch.float8_e4m3fn).float() * absmax / 448
    return torch.cat([latent.flatten(1), rows[:, rank:].to(torch.bfloat16).float()], dim=1)


def e4m3_midpoints() -> Tensor:
    """The midpoints between adjacent non-negative finite e4m3 values, where a code rounds half to even."""
    values = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).double()  # 0 .. 448 (0x7F: NaN)
    return (values[1:] + values[:-1]) / 2


def rows_near_code_boundaries(num_rows: int, rank: int, rope: int, dtype: torch.dtype, seed: int = 0) -> Tensor:
    """Rows [num_rows, R + P] whose latent values ``x`` put ``448 x / absmax`` on or within 2 ulps of the
    midpoints between e4m3 codes, each group's absmax its first value. fp32 rows: random absmax, ``x`` nudged
    around each midpoint. 16-bit rows can only hit a midpoint exactly (a quotient of 8-bit values misses one
    by far more than an ulp), and exactly where absmax / 448 is inexact only if 7 divides the midpoint: absmax
    of 6 bits, midpoints 21 x 2**s and 7 x 2**-10."""
    generator = torch.Generator().manual_seed(seed)
    groups = -(-rank // 128)
    shape = (num_rows, groups, rank // groups)
    sign = torch.randint(0, 2, shape, generator=generator).double() * 2 - 1
    midpoints = e4m3_midpoints()
    if dtype == torch.float32:
        absmax = torch.randn(num_rows, groups, 1, generator=generator, dtype=torch.float64).exp().float().double()
        picks = midpoints[torch.randint(0, len(midpoints), shape, generator=generator)]
        x = (sign * picks * absmax / 448).float()
        for _ in range(2):  # 0, 1 or 2 ulps towards zero or away
            nudge = torch.randint(-1, 2, shape, generator=generator)
            x = torch.where(nudge == 0, x, torch.nextafter(x, nudge.float() * float("inf")))
    else:
        sevens = midpoints[(midpoints * 2**10).remainder(7) == 0]
        mantissas = torch.randint(32, 64, (num_rows, groups, 1), generator=generator).double()
        mantissas = torch.where(mantissas.remainder(7) == 0, mantissas + 1, mantissas)
        absmax = mantissas * 2.0 ** torch.randint(-4, 4, mantissas.shape, generator=generator).double()
        x = sign * sevens[torch.randint(0, len(sevens), shape, generator=generator)] * absmax / 448
        assert torch.equal(x.to(dtype).double(), x), f"{dtype} holds every value exactly"
    x[..., 0] = absmax[..., 0].to(x.dtype)
    rope_keys = torch.randn(num_rows, rope, generator=generator)
    return torch.cat([x.to(dtype).flatten(1), rope_keys.to(dtype)], dim=1)


def rounded_once(rows: Tensor, rank: int) -> Tensor:
    """The e4m3 codes (uint8) of ``fl32(fl32(x * 448) / absmax)`` for rows' latents, each fp32 op computed in
    float64 and rounded once to fp32 (a product of two 24-bit numbers is exact in 53 bits; a quotient
    rounded to 53 then to 24 bits is the quotient rounded once, as 53 >= 2 x 24 + 2)."""
    groups = -(-rank // 128)
    x = rows[:, :rank].double().unflatten(-1, (groups, -1))
    absmax = x.abs().amax(dim=-1, keepdim=True)
    quotient = ((x * 448).float().double() / absmax).float()
    return quotient.to(torch.float8_e4m3fn).view(torch.uint8).flatten(1)


def dense_attention(q_latent: Tensor, q_rope: Tensor, context: Tensor, scale: float) -> Tensor:
    """One sequence's queries [Q, H, ·] over its dense context [L, R + P]: each head's keys are
    the whole rows and its values their latents; the queries are the last Q positions."""
    rank, (num_q, heads, _), length = q_latent.shape[-1], q_latent.shape, len(context)
    q = torch.cat([q_latent, q_rope], dim=-1).double().transpose(0, 1)  # [H, Q, R + P]
    k = context.double().expand(heads, length, -1)
    causal = torch.ones(num_q, length, dtype=torch.bool).tril(diagonal=length - num_q)
    out = F.scaled_dot_product_attention(q, k, k[..., :rank], attn_mask=causal, scale=scale)
    return out.transpose(0, 1)  # [Q, H, R]


def expected_output(step: Step) -> list[tuple[slice, Tensor]]:
    """Each sequence's rows of the step and the dense attention they should equal."""
    cu = step.meta.cu_seqlens_q.tolist()
    return [
        (rows, dense_attention(step.q_latent[rows], step.q_rope[rows], context, step.scale))
        for rows, context in ((slice(cu[b], cu[b + 1]), c) for b, c in enumerate(step.contexts))
    ]


def assert_stored(cache: Tensor, step: Step) -> None:
    """``cache`` holds every sequence's context at its slots, and NaN wherever nothing was written."""
    expected = step.cache.clone()
    width, block_size = expected.shape[-1], expected.shape[1]
    for b, rows in enumerate(step.stored):
        positions = torch.arange(len(rows))
        slot = step.meta.block_tables[b, positions // block_size].long() * block_size + positions % block_size
        expected.view(-1, width)[slot] = rows
    torch.testing.assert_close(cache.cpu(), expected, rtol=0, atol=0, equal_nan=True)


# name: (q_lens, context_lens, pad_tokens, pad_seqs)
BATCHES = {
    "decode": ([1, 1, 1], [5, 33, 17], 0, 0),
    "prefill": ([7, 20], [7, 20], 0, 0),
    "chunked-prefill": ([9], [40], 0, 0),
    "mixed-padded": ([1, 12, 1, 5], [50, 12, 1, 21], 3, 2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("batch", BATCHES)
def test_reference_equals_dense_attention(batch, dtype):
    q_lens, context_lens, pad_tokens, pad_seqs = BATCHES[batch]
    step = paged_step(q_lens, context_lens, heads=4, rank=32, rope=16, dtype=dtype, pad_tokens=pad_tokens,
                      pad_seqs=pad_seqs)  # fmt: skip
    q_latent, q_rope, latent, cache, meta, scale = step.args()
    out = mla_attention(q_latent, q_rope, latent, cache, meta, scale)
    assert out.dtype == dtype and out.shape == step.q_latent.shape
    assert_stored(cache, step)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's rounding
    for rows, expected in expected_output(step):
        torch.testing.assert_close(out[rows].double(), expected, rtol=tol, atol=tol)
    assert (out[sum(q_lens) :] == 0).all()  # rows of no sequence


DEVICE = torch.device(os.environ["XINFER_KERNEL_DEVICE"])
ON_GPU = DEVICE.type == "cuda"
# (the interpreter computes in numpy, which has no bfloat16)
KERNEL_DTYPES = [torch.float32, torch.float16, torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]
KERNEL_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def assert_kernel_matches_reference(step: Step, **overrides) -> None:
    fp8 = step.cache.dtype == torch.uint8
    kernel, reference = (mla.mla_attention_fp8, mla_attention_fp8) if fp8 else (mla.mla_attention, mla_attention)
    q_latent, q_rope, latent, cache, meta, scale = step.args(DEVICE)
    out = kernel(q_latent, q_rope, latent, cache, meta, scale, **overrides)
    expected = reference(*step.args())
    assert out.dtype == step.q_latent.dtype and out.shape == step.q_latent.shape
    assert_stored(cache, step)
    tol = KERNEL_TOL[out.dtype]
    rows = slice(0, int(step.meta.cu_seqlens_q[-1]))  # (rows of no sequence are left as they are)
    torch.testing.assert_close(out[rows].cpu().float(), expected[rows].float(), rtol=tol, atol=tol)


KERNEL_CASES = [(batch, dtype, None) for batch in BATCHES for dtype in KERNEL_DTYPES]
KERNEL_CASES += [("decode", KERNEL_DTYPES[-1], 3), ("mixed-padded", torch.float32, 3)]  # split contexts


@pytest.mark.parametrize("batch, dtype, num_splits", KERNEL_CASES, ids=str)
def test_kernel_matches_the_reference(batch, dtype, num_splits):
    """20 heads: two groups of 16, the second part padding."""
    q_lens, context_lens, pad_tokens, pad_seqs = BATCHES[batch]
    step = paged_step(q_lens, context_lens, heads=20, rank=32, rope=16, dtype=dtype, pad_tokens=pad_tokens,
                      pad_seqs=pad_seqs, seed=len(q_lens))  # fmt: skip
    assert_kernel_matches_reference(step, num_splits=num_splits)


def test_kernel_with_fewer_heads_than_a_tile_holds():
    """4 heads: a prefill tile holds several queries' heads, a decode program masks the rest."""
    q_lens, context_lens, pad_tokens, pad_seqs = BATCHES["mixed-padded"]
    assert_kernel_matches_reference(paged_step(q_lens, context_lens, heads=4, rank=32, rope=16, pad_tokens=pad_tokens,
                                               pad_seqs=pad_seqs))  # fmt: skip


def test_kernel_at_deepseek_v3_sizes_on_query_views():
    """R 512, P 64, 16 heads (V2-Lite's); the queries as the layer makes them: ``q_latent`` a
    head-major product seen token-major, ``q_rope`` a slice of the projected query."""
    dtype = torch.bfloat16 if ON_GPU else torch.float16
    step = paged_step([1, 6, 1], [40, 6, 19], heads=16, rank=512, rope=64, dtype=dtype, pad_tokens=1, seed=3)
    step.q_latent = step.q_latent.transpose(0, 1).contiguous().transpose(0, 1)
    step.q_rope = torch.cat([torch.zeros_like(step.q_rope), step.q_rope], dim=-1)[..., 64:]
    assert_kernel_matches_reference(step, num_splits=2)


# (q_lens, context_lens, block_size): at DeepSeek V3's sizes with its 128 heads, contexts that split
GPU_STEPS = [([1, 1, 1, 1], [1000, 4097, 17, 2500], 64), ([1, 256, 1], [3000, 1300, 64], 16), ([512], [512], 64)]


@pytest.mark.skipif(not ON_GPU, reason="the interpreter would take minutes at these sizes")
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-rows", "fp8-rows"])
@pytest.mark.parametrize("q_lens, context_lens, block_size", GPU_STEPS, ids=str)
def test_kernel_at_deepseek_v3_sizes_on_long_contexts(q_lens, context_lens, block_size, fp8):
    step = paged_step(q_lens, context_lens, heads=128, rank=512, rope=64, dtype=torch.bfloat16, block_size=block_size,
                      pad_tokens=2, pad_seqs=1, fp8=fp8)  # fmt: skip
    assert_kernel_matches_reference(step)


@pytest.mark.parametrize("rank, rope", [(512, 64), (32, 16)])
def test_fp8_rows_hold_the_documented_layout(rank, rope):
    generator = torch.Generator().manual_seed(rank)
    rows = torch.randn(37, rank + rope, generator=generator) * torch.rand(37, 1, generator=generator) * 10
    rows[3, :rank] = 0  # an all-zero latent stays zero
    stored = encode_fp8(rows, rank)
    groups = -(-rank // 128)
    assert stored.dtype == torch.uint8 and stored.shape == (37, fp8_row_bytes(rank, rope))
    assert stored.shape[1] == rank + 4 * groups + 2 * rope and fp8_row_bytes(512, 64) == 656
    latent = rows[:, :rank].unflatten(-1, (groups, -1))
    group_scales = stored[:, rank : rank + 4 * groups].contiguous().view(torch.float32)
    torch.testing.assert_close(group_scales, latent.abs().amax(-1).clamp_min(1e-12), rtol=0, atol=0)
    decoded = stored[:, :rank].view(torch.float8_e4m3fn).float().unflatten(-1, (groups, -1))
    decoded = decoded * group_scales[..., None] / 448
    torch.testing.assert_close(decoded.flatten(1), dequantized(rows, rank)[:, :rank], rtol=0, atol=0)
    bound = latent.abs() / 16 + latent.abs().amax(-1, keepdim=True) * 2**-18  # e4m3: 3 mantissa bits
    assert ((decoded - latent).abs() <= bound).all()
    rope_keys = stored[:, rank + 4 * groups :].contiguous().view(torch.bfloat16)
    assert torch.equal(rope_keys, rows[:, rank:].to(torch.bfloat16))


@pytest.mark.parametrize("batch", BATCHES)
def test_fp8_reference_equals_dense_attention_over_the_dequantized_rows(batch):
    q_lens, context_lens, pad_tokens, pad_seqs = BATCHES[batch]
    step = paged_step(q_lens, context_lens, heads=4, rank=32, rope=16, pad_tokens=pad_tokens, pad_seqs=pad_seqs,
                      fp8=True)  # fmt: skip
    q_latent, q_rope, latent, cache, meta, scale = step.args()
    out = mla_attention_fp8(q_latent, q_rope, latent, cache, meta, scale)
    assert_stored(cache, step)
    for rows, expected in expected_output(step):
        torch.testing.assert_close(out[rows].double(), expected, rtol=1e-5, atol=1e-5)


FP8_CASES = [("mixed-padded", KERNEL_DTYPES[-1], None), ("decode", torch.float32, 3)]


@pytest.mark.parametrize("batch, dtype, num_splits", FP8_CASES, ids=str)
def test_fp8_kernel_matches_the_reference(batch, dtype, num_splits):
    q_lens, context_lens, pad_tokens, pad_seqs = BATCHES[batch]
    step = paged_step(q_lens, context_lens, heads=20, rank=32, rope=16, dtype=dtype, pad_tokens=pad_tokens,
                      pad_seqs=pad_seqs, fp8=True)  # fmt: skip
    assert_kernel_matches_reference(step, num_splits=num_splits)


def test_fp8_kernel_at_deepseek_v3_sizes():
    dtype = torch.bfloat16 if ON_GPU else torch.float16
    step = paged_step([1, 6, 1], [300, 6, 19], heads=16, rank=512, rope=64, dtype=dtype, pad_tokens=1, fp8=True)
    assert_kernel_matches_reference(step, num_splits=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_fp8_codes_round_each_latent_value_once_on_the_kernels_device(dtype):
    """Rows as the model makes them (fp32 on the CPU, bf16 on a GPU) encoded where the kernels run, against
    the codes worked out in float64: a step ``absmax / 448`` rounded before the division (on the CPU) or
    taken as ``absmax * (1 / 448)`` (torch on CUDA, for a division by a Python number) sends about half
    of these values to the neighbouring code."""
    rows = rows_near_code_boundaries(512, rank=512, rope=64, dtype=dtype)
    stored = encode_fp8(rows.to(DEVICE), 512).cpu()
    codes, expected = stored[:, :512], rounded_once(rows, 512)
    assert (codes != expected).sum() == 0, f"{(codes != expected).sum()} of {codes.numel()} codes differ"


@pytest.mark.parametrize("dtype", [torch.float32, KERNEL_DTYPES[-1]], ids=str)
def test_fp8_kernel_stores_rows_near_code_boundaries_as_the_reference(dtype):
    """Every row of a decode step of 64 sequences on a rounding boundary: the kernel path's stored bytes
    (encoded on the kernels' device) equal the reference's (encoded on the CPU)."""
    step = paged_step([1] * 64, [3] * 64, heads=16, rank=512, rope=64, dtype=dtype, fp8=True)
    boundary_rows = rows_near_code_boundaries(3 * 64, rank=512, rope=64, dtype=dtype, seed=1).split(3)
    step.latent = torch.stack([rows[-1] for rows in boundary_rows])
    step.stored = [encode_fp8(rows, 512) for rows in boundary_rows]
    for b, rows in enumerate(step.stored):  # the two cached rows of each sequence
        slots = step.meta.block_tables[b, 0].long() * 16 + torch.arange(2)
        step.cache.view(-1, rows.shape[-1])[slots] = rows[:2]
    q_latent, q_rope, latent, cache, meta, scale = step.args(DEVICE)
    mla.mla_attention_fp8(q_latent, q_rope, latent, cache, meta, scale)
    assert_stored(cache, step)

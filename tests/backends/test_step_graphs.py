"""Steps padded to captured shapes (what the CUDA graphs record), run eagerly on the CPU:
the bucketing and padding as functions, and padded steps giving the unpadded steps'
logits and tokens on a tiny model, through the CPU backend and through the CUDA
backend's kernels (under the Triton interpreter here)."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from transformers import LlamaConfig

from tests.tiny_models import COMMON, gemma3_config, prompt, save_tiny_model
from xinfer import LLM, SamplingParams, ops
from xinfer.engine.runner import ModelRunner
from xinfer.engine.sequence import PENDING
from xinfer.ops import DeviceTokens, HostBatch, PageBatch, StepLimits
from xinfer.sampling import SampledRow, SamplingBatch
from xinfer_cpu.ops import CpuOps
from xinfer_cuda.ops import CudaOps
from xinfer_cuda.static_step import (
    SHORT_CONTEXT,
    Bucket,
    StaticStep,
    decode_sizes,
    pad_batch,
    pick_bucket,
    step_buckets,
    token_sizes,
)

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def host_batch(q_lens: list[int], seq_lens: list[int], sampled: list[bool], block_size: int = 4) -> HostBatch:
    batch = HostBatch([], [], [0], [], [], [PageBatch()])
    page = batch.pages[0]
    for b, (q_len, seq_len, sample) in enumerate(zip(q_lens, seq_lens, sampled)):
        batch.input_ids += [7] * q_len
        batch.positions += range(seq_len - q_len, seq_len)
        page.slot_mapping += [100 * b + p for p in range(seq_len - q_len, seq_len)]
        batch.cu_seqlens_q.append(batch.cu_seqlens_q[-1] + q_len)
        batch.seq_lens.append(seq_len)
        page.block_tables.append(list(range(b, b + -(-seq_len // block_size))))
        if sample:
            batch.sample_rows.append(batch.cu_seqlens_q[-1] - 1)
    return batch


def test_ladders():
    assert decode_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert decode_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    large = decode_sizes(1024)
    assert large[-9:] == [512, 576, 640, 704, 768, 832, 896, 960, 1024] and len(large) == 36
    assert all(b <= a * 1.125 for a, b in itertools.pairwise(large[large.index(128) :])), large  # by an eighth
    assert token_sizes(300) == [64, 80, 96, 112, 128, 160, 192, 224, 256, 300]
    assert token_sizes(20) == [20]
    sizes = token_sizes(8192)
    assert sizes[0] == 64 and sizes[-1] == 8192 and sizes == sorted(set(sizes))
    # any step of 64 or more tokens is padded by at most a quarter
    assert all(b <= a * 1.25 for a, b in itertools.pairwise(sizes)), sizes
    buckets = step_buckets(StepLimits(max_num_seqs=100, max_num_tokens=160, max_blocks_per_seq=8, max_seq_len=32))
    assert [b for b in buckets if not b.decode] == [
        Bucket(64, 64, False), Bucket(80, 80, False), Bucket(96, 96, False), Bucket(112, 100, False),
        Bucket(128, 100, False), Bucket(160, 100, False),
    ]  # fmt: skip
    assert [b.num_tokens for b in buckets if b.decode] == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100]


def test_pick_bucket_by_kind_and_size():
    buckets = step_buckets(StepLimits(max_num_seqs=8, max_num_tokens=256, max_blocks_per_seq=8, max_seq_len=32))
    decode = host_batch([1, 1, 1], [5, 9, 2], [True] * 3)
    assert pick_bucket(buckets, decode) == Bucket(4, 4, True)
    mixed = host_batch([1, 1, 70], [5, 9, 70], [True, True, False])
    assert pick_bucket(buckets, mixed) == Bucket(80, 8, False)  # 72 tokens
    chunk = host_batch([1], [5], [False])  # one prompt token, not the last: not a decode step
    assert pick_bucket(buckets, chunk) == Bucket(64, 8, False)
    assert pick_bucket(buckets, host_batch([257], [257], [True])) is None


def test_small_decode_batches_have_short_context_buckets():
    """Decode batches of up to SHORT_CONTEXT_SEQS sequences whose block tables fit
    SHORT_CONTEXT tokens take a bucket of that table width (few decode splits, merged
    without the reduce launch); wider ones, and larger batches, the full width."""
    limits = StepLimits(max_num_seqs=16, max_num_tokens=256, max_blocks_per_seq=256, max_seq_len=4096)
    buckets = step_buckets(limits)
    short = [b for b in buckets if b.max_blocks is not None]
    assert short == [Bucket(n, n, True, SHORT_CONTEXT * 256 // 4096) for n in (1, 2, 4, 8)]
    block = 4096 // 256
    fits = host_batch([1, 1], [SHORT_CONTEXT, 9], [True] * 2, block_size=block)
    assert pick_bucket(buckets, fits) == Bucket(2, 2, True, SHORT_CONTEXT // block)
    wider = host_batch([1, 1], [SHORT_CONTEXT + 1, 9], [True] * 2, block_size=block)
    assert pick_bucket(buckets, wider) == Bucket(2, 2, True)
    many = host_batch([1] * 9, [5] * 9, [True] * 9, block_size=block)
    assert pick_bucket(buckets, many) == Bucket(16, 16, True)
    seen = []

    def forward(ids, positions, context, rows):
        seen.append(context.seqs.block_tables)
        return torch.zeros(len(rows), 3)

    step = StaticStep(forward, limits, torch.device("cpu"))
    bucket = Bucket(2, 2, True, SHORT_CONTEXT // block)
    step.load(fits, bucket)
    step.run(bucket)
    assert seen[0].tolist() == fits.pages[0].block_tables[:1] + [fits.pages[0].block_tables[1] + [0] * 63]


def test_load_writes_the_sampled_rows_parameters_in_the_step_s_input_copy():
    limits = StepLimits(max_num_seqs=4, max_num_tokens=64, max_blocks_per_seq=8, max_seq_len=32)
    step = StaticStep(None, limits, torch.device("cpu"))
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1)
    rows = [SampledRow(params, 2**40 + i, 7 + i) for i in range(3)]
    step.load(host_batch([1, 1, 1], [5, 9, 2], [True] * 3), Bucket(4, 4, True), sampling=rows)
    expected = SamplingBatch.of(rows, 4)  # the fourth row: greedy padding
    for field in SamplingBatch.INTS + SamplingBatch.FLOATS:
        assert getattr(step.sampling, field).tolist() == getattr(expected, field).tolist(), field
    assert step._rows(step.dev64).tolist() == [0, 1, 2, 0]  # the sample rows just before them


def test_resident_rows_give_each_step_its_tables_however_they_changed():
    """A step's tables, gathered from the rows kept on the device, are its rows padded
    (0; -1 for shadows), after rows grew in place, changed order, were replaced (a trim),
    dropped, or came new into a slot a longer row held."""
    limits = StepLimits(max_num_seqs=3, max_num_tokens=64, max_blocks_per_seq=6, max_seq_len=24, shadows=True)
    seen = []

    def forward(ids, positions, context, rows):
        meta = context.seqs
        seen.append((meta.block_tables.tolist(), meta.shadows.tables.tolist()))
        return torch.zeros(len(rows), 3)

    def decode(tables: list[list[int]], shadows: list[list[int]]) -> HostBatch:
        n = len(tables)
        pages = [PageBatch([0] * n, tables, PageBatch([-1] * n, shadows))]
        return HostBatch([7] * n, [0] * n, list(range(n + 1)), [4 * len(t) for t in tables], list(range(n)), pages)

    step = StaticStep(forward, limits, torch.device("cpu"))
    a, b, a_shadows, b_shadows = [5, 6, 7, 8, 9], [1], [50, 60, 70, 80, 90], [10]
    c, trimmed, c_shadows, trimmed_shadows = [2, 3], [-1, -1, 7, 8, 9, 4], [20, 30], [-1, -1, 70, 80, 90, 40]
    steps = [([a, b], [a_shadows, b_shadows])]
    b.append(4), b_shadows.append(40)  # a block allocated in place
    steps.append(([b, a], [b_shadows, a_shadows]))
    steps.append(([c, trimmed], [c_shadows, trimmed_shadows]))  # b dropped, a replaced
    steps.append(([[11]], [[110]]))  # new, into a slot a longer row held
    bucket = Bucket(3, 3, True)
    for tables, shadows in steps:
        step.load(decode(tables, shadows), bucket)
        step.run(bucket)
        padding = [[]] * (3 - len(tables))
        assert seen[-1] == (
            [row + [0] * (6 - len(row)) for row in tables + padding],
            [row + [-1] * (6 - len(row)) for row in shadows + padding],
        )


def test_pad_batch():
    batch = host_batch([2, 1], [2, 6], [True, True])
    padded = pad_batch(batch, Bucket(8, 4, False))
    assert padded.input_ids == [7, 7, 7, 0, 0, 0, 0, 0]
    assert padded.positions == [0, 1, 5, 0, 0, 0, 0, 0]
    assert padded.pages[0].slot_mapping == [0, 1, 105, -1, -1, -1, -1, -1]
    assert padded.cu_seqlens_q == [0, 2, 3, 3, 3]
    assert padded.seq_lens == [2, 6, 0, 0]
    assert padded.pages[0].block_tables == [[0], [1, 2]]  # as they are: the step's resident rows take them
    assert padded.sample_rows == [1, 2, 0, 0]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A Llama (one page group) and a Gemma 3 with sliding and full layers (two)."""
    llama, gemma = tmp_path_factory.mktemp("llama"), tmp_path_factory.mktemp("gemma3")
    save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), llama)
    save_tiny_model(gemma3_config(sliding_window=12), gemma)
    return {"llama": str(llama), "gemma3": str(gemma)}


LIMITS = dict(max_num_seqs=6, max_num_batched_tokens=128)


def mixed_and_decode_batches(llm: LLM) -> list[HostBatch]:
    """Steps of decodes with a new prompt's first chunk, then with its last, then decodes."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, length in enumerate((5, 17, 3)):
        engine.add_request(f"early-{i}", prompt(length, seed=i), params)
    engine.step()
    engine.step()  # decoding now
    engine.add_request("late", prompt(150, seed=9), params)  # its first chunk joins the decodes
    batches, steps = [], []
    prepare = engine.runner.prepare

    def recording(scheduled):
        steps.append([item.seq for item in scheduled])
        batches.append(prepare(scheduled))
        return batches[-1]

    engine.runner.prepare = recording
    for _ in range(3):
        engine.step()
    engine.step()  # reads the third step's tokens back
    for batch, seqs in zip(batches, steps):  # inputs that were still on the device, as the host now has them
        for seq, end in zip(seqs, batch.cu_seqlens_q[1:]):
            if batch.input_ids[end - 1] == PENDING:
                batch.input_ids[end - 1] = seq.token_ids[batch.positions[end - 1]]
    return batches[:3]


INTERPRETED = os.environ["XINFER_KERNEL_DEVICE"] == "cpu"  # the CUDA kernels take CPU tensors


# a quantized cache with a recent window: steps carry shadow tables and slots too; a model
# with sliding layers: steps carry a page group per window
CACHES = {
    "auto": ("llama", {}),
    "fp8-window": ("llama", dict(kv_cache_dtype="fp8", kv_recent_window=8)),
    "sliding": ("gemma3", {}),
    "sliding-fp8-window": ("gemma3", dict(kv_cache_dtype="fp8", kv_recent_window=8)),
}


# the CUDA kernels, interpreted (minutes a case), in the two extremes: one page group without shadows, and
# two page groups with shadows (sliding layers under an fp8 recent window); the CPU backend in all four
CUDA_KERNELS = pytest.mark.skipif(not INTERPRETED, reason="tests/gpu covers the GPU")
PADDED_CASES = [
    *(pytest.param(CpuOps(), cache, id=f"cpu-{cache}") for cache in CACHES),
    *(pytest.param(CudaOps(), cache, id=f"cuda-kernels-{cache}", marks=CUDA_KERNELS)
      for cache in ("auto", "sliding-fp8-window")),
]  # fmt: skip


@pytest.mark.parametrize(("backend", "cache"), PADDED_CASES)
def test_padded_step_gives_the_unpadded_logits(model_dirs, backend, cache):
    model, options = CACHES[cache]
    llm = LLM(model=model_dirs[model], dtype="float32", device="cpu", num_blocks=128, **LIMITS, **options)
    runner: ModelRunner = llm.engine.runner
    runner.backend = backend
    batches = mixed_and_decode_batches(llm)
    assert [b.is_decode for b in batches] == [False, False, True]
    assert [len(b.sample_rows) for b in batches] == [3, 4, 4]  # the first chunk samples nothing
    shadows = bool(options)
    assert all(len(b.pages) == (2 if model == "gemma3" else 1) for b in batches)
    assert all((p.shadows is not None) == shadows for b in batches for p in b.pages)
    max_blocks = -(-llm.engine.max_model_len // runner.block_size)
    limits = StepLimits(6, 128, max_blocks, llm.engine.max_model_len, len(batches[0].pages), shadows)
    step = StaticStep(runner.forward, limits, torch.device("cpu"))
    with torch.inference_mode(), ops.use(backend):
        for batch in batches:  # their KV is in the cache: rewriting it is harmless
            bucket = pick_bucket(step_buckets(limits), batch)
            eager = runner.forward(*runner.to_device(batch), torch.tensor(batch.sample_rows))
            step.load(batch, bucket)
            padded = step.run(bucket)[: len(batch.sample_rows)]
            torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)


class EagerStaticSteps:
    """The step graphs' runner without capture: pad, load, run (None where no bucket fits, as
    :class:`~xinfer_cuda.graphs.StepGraphs`)."""

    def __init__(self, runner: ModelRunner, limits: StepLimits):
        self.step = StaticStep(runner.forward, limits, runner.device)
        self.buckets = step_buckets(limits)
        self.used: list[Bucket] = []

    def __call__(self, batch: HostBatch, pending: DeviceTokens | None = None, sampling: list[SampledRow] = ()):
        bucket = pick_bucket(self.buckets, batch)
        if bucket is None or not self.step.fits(batch):
            return None
        self.used.append(bucket)
        self.step.load(batch, bucket, pending, sampling)
        rows = len(batch.sample_rows)
        return self.step.run(bucket)[:rows], self.step.sample(bucket)[:rows]


@pytest.mark.parametrize("cache", CACHES)
def test_engine_with_padded_steps_gives_the_eager_tokens(model_dirs, cache):
    model, options = CACHES[cache]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [prompt(3 + 29 * i, seed=i) for i in range(8)]
    eager = LLM(model=model_dirs[model], dtype="float32", device="cpu", num_blocks=256, **LIMITS, **options)
    padded = LLM(model=model_dirs[model], dtype="float32", device="cpu", num_blocks=256, **LIMITS, **options)
    engine = padded.engine
    max_blocks = -(-engine.max_model_len // engine.runner.block_size)
    limits = StepLimits(6, 128, max_blocks, engine.max_model_len, engine.runner.num_page_groups, bool(options))
    engine.runner.graphs = steps = EagerStaticSteps(engine.runner, limits)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in padded.generate(prompts, params)] == expected
    assert {b.decode for b in steps.used} == {True, False}

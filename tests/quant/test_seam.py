"""The quantized-weight seam: ops on packed weights against dequantize-then-compute (the reference
every backend can run), the CPU backend's repacked fast path against the reference, and formats and
kernels coming from plugins."""

from __future__ import annotations

import copy
import pickle
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.quant.test_gguf_formats import FORMATS, random_blocks
from xinfer import ops, registry
from xinfer.hooks import hookimpl
from xinfer.layers.embedding import VocabEmbedding
from xinfer.quant import QuantizedTensor, WeightFormat, WeightKernels, cat_rows, get_weight_format, quantized
from xinfer.quant.dispatch import kernels_for, prepare_weights
from xinfer.torch_ops import TorchOps
from xinfer_cpu.ops import CpuOps
from xinfer_cpu.quant import WEIGHT_KERNELS, _int4_codes, int4_rows_readable

# the CPU's int4 matmul takes bf16 activations and bf16 scales: about 2^-8 relative
FAST_PATH_TOLERANCE = 2e-2


def packed(name: str, shape: tuple[int, ...], seed: int = 0) -> QuantizedTensor:
    fmt = get_weight_format(name)
    *outer, rows, cols = shape
    lead = int(torch.tensor(outer).prod()) if outer else 1
    raw = torch.from_numpy(random_blocks(name, lead * rows, cols // fmt.block_values, seed))
    return quantized(raw.reshape(*shape[:-1], -1), fmt, shape)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize("name", FORMATS)
def test_linear_reference_is_dequantize_then_matmul(name: str) -> None:
    weight = packed(name, (40, 512))
    x, bias = torch.randn(3, 512), torch.randn(40)
    with ops.use(TorchOps()):
        got = ops.linear(x, weight, bias)
    torch.testing.assert_close(got, F.linear(x, weight.dequantize(), bias), rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(WEIGHT_KERNELS))
@pytest.mark.parametrize("tokens", [1, 7])
def test_cpu_fast_path_matches_the_reference(name: str, tokens: int) -> None:
    backend = CpuOps()
    weight = packed(name, (48, 512), seed=tokens)
    prepared = kernels_for(backend, name).prepare(weight)
    assert prepared.format.name != name and prepared.format.name.startswith(name)
    x, bias = torch.randn(tokens, 512), torch.randn(48)
    expected = F.linear(x, weight.dequantize(), bias)
    with ops.use(backend):
        got = ops.linear(x, prepared, bias)
    assert got.dtype == x.dtype and got.shape == expected.shape
    assert relative_error(got, expected) <= FAST_PATH_TOLERANCE
    assert relative_error(prepared.dequantize(), weight.dequantize()) <= FAST_PATH_TOLERANCE


@pytest.mark.parametrize("name", sorted(WEIGHT_KERNELS))
def test_cpu_fast_path_gives_a_row_the_same_values_in_any_batch(name: str) -> None:
    """Bit for bit: a seeded or greedy request's logits do not depend on what else is in the batch."""
    backend = CpuOps()
    weight = kernels_for(backend, name).prepare(packed(name, (208, 256)))  # a last tile of 16 rows
    x = torch.randn(37, 256)
    with ops.use(backend):
        alone = [ops.linear(x[i : i + 1], weight) for i in (0, 5, 36)]
        for rows in (2, 5, 8, 17, 37):
            batch = ops.linear(x[:rows], weight)
            assert all(torch.equal(batch[i : i + 1], a) for i, a in zip((0, 5, 36), alone) if i < rows)


def test_rows_in_different_formats_run_part_by_part() -> None:
    """A merged q/k/v whose shards the file stores in Q5_0 and Q8_0 (Gemma 3's Q4_K_M)."""
    q, v = packed("q5_0", (64, 256)), packed("q8_0", (32, 256), seed=1)
    merged = cat_rows([q, v])
    assert merged.parts is not None and merged.logical_shape == (96, 256)
    assert merged.nbytes == q.nbytes + v.nbytes
    x = torch.randn(4, 256)
    expected = x @ torch.cat([q.dequantize(), v.dequantize()]).T
    with ops.use(TorchOps()):
        torch.testing.assert_close(ops.linear(x, merged), expected, rtol=0, atol=1e-4)
    backend = CpuOps()
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(merged, requires_grad=False)
    prepare_weights(model, backend)
    with ops.use(backend):
        assert relative_error(ops.linear(x, model.weight), expected) <= FAST_PATH_TOLERANCE


def test_a_part_after_one_of_unaligned_bytes_is_repacked_and_run() -> None:
    """3 Q3_K rows are 330 bytes: the Q6_K part after them, repacked by the CPU backend into int4 codes
    and bf16 scales, is viewed as those words (from an aligned start) and gives its values' product."""
    short, long = packed("q3_k", (3, 256)), packed("q6_k", (16, 256), seed=1)
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(cat_rows([short, long]), requires_grad=False)
    backend = CpuOps()
    prepare_weights(model, backend)
    assert [p.format.name for p in model.weight.parts or ()] == ["q3_k", "q6_k:cpu-int4x16"]
    x = torch.randn(4, 256)
    expected = x @ torch.cat([short.dequantize(), long.dequantize()]).T
    with ops.use(backend):
        assert relative_error(ops.linear(x, model.weight), expected) <= FAST_PATH_TOLERANCE


def test_same_format_rows_merge_into_one_tensor() -> None:
    gate, up = packed("q4_1", (24, 64)), packed("q4_1", (24, 64), seed=1)
    merged = cat_rows([gate, up])
    assert merged.parts is None and merged.format.name == "q4_1"
    torch.testing.assert_close(merged.dequantize(), torch.cat([gate.dequantize(), up.dequantize()]))


def test_neighbouring_rows_of_one_format_join_into_one_part() -> None:
    """Q4_K_M's q and k in Q4_K, its v in Q6_K: two parts, q and k one (one kernel call for them); a part that
    joins an earlier merge's joins too, and parts of one format that are not neighbours stay apart."""
    q, k, v = packed("q4_k", (16, 256)), packed("q4_k", (8, 256), seed=1), packed("q6_k", (8, 256), seed=2)
    merged = cat_rows([q, k, v])
    assert [(p.format.name, p.logical_shape) for p in merged.parts or ()] == [("q4_k", (24, 256)), ("q6_k", (8, 256))]
    expected = torch.cat([q.dequantize(), k.dequantize(), v.dequantize()])
    torch.testing.assert_close(merged.dequantize(), expected, rtol=0, atol=0)
    more = cat_rows([merged, packed("q6_k", (4, 256), seed=3), q])
    assert [(p.format.name, p.logical_shape[0]) for p in more.parts or ()] == [("q4_k", 24), ("q6_k", 12), ("q4_k", 16)]
    x = torch.randn(3, 256)
    with ops.use(TorchOps()):
        torch.testing.assert_close(ops.linear(x, more), x @ more.dequantize().T, rtol=0, atol=1e-4)


@pytest.mark.parametrize("move", [lambda t: t.cpu(), lambda t: t.to("cpu"), lambda t: t.to(torch.device("meta"))])
def test_moving_a_packed_weight_keeps_its_format(move) -> None:
    weight = cat_rows([packed("q5_0", (64, 256)), packed("q8_0", (32, 256), seed=1)])
    moved = move(weight)
    assert isinstance(moved, QuantizedTensor) and moved.logical_shape == (96, 256)
    assert [p.format.name for p in moved.parts or ()] == ["q5_0", "q8_0"]
    if moved.device.type == "cpu":
        torch.testing.assert_close(moved.dequantize(), weight.dequantize(), rtol=0, atol=0)
    with pytest.raises(TypeError, match="dequantize"):
        weight.to(torch.float16)


@pytest.mark.parametrize(
    "duplicate", [copy.deepcopy, lambda t: pickle.loads(pickle.dumps(t))], ids=["deepcopy", "pickle"]
)
def test_a_copied_weight_in_parts_keeps_them(duplicate) -> None:
    weight = cat_rows([packed("q5_0", (64, 256)), packed("q8_0", (32, 256), seed=1)])
    copied = duplicate(weight)
    assert [p.format.name for p in copied.parts or ()] == ["q5_0", "q8_0"]
    assert copied.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()
    torch.testing.assert_close(copied.dequantize(), weight.dequantize(), rtol=0, atol=0)


@pytest.mark.parametrize("backend", [TorchOps(), CpuOps()], ids=["reference", "cpu"])
def test_fused_moe_on_packed_experts_is_dequantize_then_compute(backend) -> None:
    experts, hidden, inner, tokens = 4, 256, 256, 6
    w13, w2 = packed("q4_k", (experts, 2 * inner, hidden)), packed("q6_k", (experts, hidden, inner), seed=1)
    x = torch.randn(tokens, hidden)
    generator = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(experts, generator=generator)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=generator)
    expected = TorchOps().fused_moe(x, w13.dequantize(), w2.dequantize(), weights, ids, "silu")
    with ops.use(backend):
        got = ops.fused_moe(x, w13, w2, weights, ids, "silu")
    assert relative_error(got, expected) <= 1e-5


@pytest.mark.parametrize("rows", [64, 80, 112])  # whole tiles of torch's int4 layout, and a last tile of 16 or 48
@pytest.mark.parametrize("name, repacked", [("q8_0", None), ("q8_0", "q8_0:cpu-int4x2"), ("q4_k", "q4_k:cpu-int4"), ("q5_k", "q5_k:cpu-int4x2"), ("q6_k", "q6_k:cpu-int4x16")])  # fmt: skip
def test_embedding_dequantizes_only_the_rows_looked_up(name: str, repacked: str | None, rows: int) -> None:
    """Rows read back from the CPU's int4 layout are the file's values but for the repack's bf16 scales and zeros
    (a value's error at most 2^-9 of its scale and zero each)."""
    table = packed(name, (rows, 256))
    embedding = VocabEmbedding(rows, 256)
    embedding.weight = torch.nn.Parameter(table, requires_grad=False)
    ids = torch.tensor([[3, rows - 1], [0, 3], [63, rows - 17]])
    if not repacked:
        torch.testing.assert_close(embedding(ids), table.dequantize()[ids], rtol=0, atol=0)
        return
    prepare_weights(embedding, CpuOps())
    assert embedding.weight.format.name == repacked
    assert embedding.weight.nbytes == rows * 256 // 32 * 20 * (1 if name == "q4_k" else 2)  # no second copy
    assert relative_error(embedding(ids), table.dequantize()[ids]) <= 2**-8
    x = torch.randn(3, 256)  # and the tied LM head runs the repacked kernel
    with ops.use(CpuOps()):
        got = ops.linear(x, embedding.weight)
    assert relative_error(got, x @ table.dequantize().T) <= FAST_PATH_TOLERANCE


@pytest.mark.parametrize("rows", [16, 48, 64, 96, 208])
def test_int4_codes_read_back_from_torchs_cpu_layout(rows: int) -> None:
    q = torch.randint(0, 16, (rows, 128), generator=torch.Generator().manual_seed(rows), dtype=torch.int32)
    layout = torch._convert_weight_to_int4pack_for_cpu(q, 2)
    index = torch.tensor([rows - 1, 0, rows // 2, rows - 1])
    assert torch.equal(_int4_codes(layout, index), q[index])
    assert int4_rows_readable()


def test_a_table_whose_rows_torch_cannot_pack_is_left_as_stored() -> None:
    embedding = VocabEmbedding(50, 64)  # torch's int4 packing takes rows in multiples of 16
    embedding.weight = torch.nn.Parameter(packed("q4_0", (50, 64)), requires_grad=False)
    prepare_weights(embedding, CpuOps())
    assert embedding.weight.format.name == "q4_0"


def test_a_table_is_left_as_stored_where_this_torchs_int4_layout_is_not_the_one_read(monkeypatch) -> None:
    import xinfer_cpu.quant

    monkeypatch.setattr(xinfer_cpu.quant, "int4_rows_readable", lambda: False)
    model = torch.nn.Module()
    model.embedding = VocabEmbedding(64, 256)
    model.embedding.weight = torch.nn.Parameter(packed("q8_0", (64, 256)), requires_grad=False)
    model.linear = torch.nn.Linear(256, 64, bias=False)
    model.linear.weight = torch.nn.Parameter(packed("q8_0", (64, 256)), requires_grad=False)
    prepare_weights(model, CpuOps())
    assert (model.embedding.weight.format.name, model.linear.weight.format.name) == ("q8_0", "q8_0:cpu-int4x2")
    index = torch.tensor([1, 5])  # and a repacked weight's rows, asked for anyway, come from its whole values
    assert torch.equal(model.linear.weight.dequantize_rows(index), model.linear.weight.dequantize()[index])


class Int8Rows(WeightFormat):
    """A third party's format: int8 values with one f32 scale per row, stored after the values."""

    name, block_values, block_bytes = "int8-rows", 64, 68

    def dequantize(self, raw: torch.Tensor) -> torch.Tensor:
        q, scale = raw[..., :64].view(torch.int8).float(), raw[..., 64:].contiguous().view(torch.float32)
        return q * scale

    def quantize(self, values: torch.Tensor) -> torch.Tensor:
        scale = values.abs().amax(-1, keepdim=True) / 127
        q = torch.round(values / scale).to(torch.int8).view(torch.uint8)
        return torch.cat([q, scale.contiguous().view(torch.uint8)], dim=-1)

    kernels = {"cpu": f"{__name__}:CountingKernels"}


class CountingKernels(WeightKernels):
    calls = 0
    norm_calls = 0

    def linear(self, x, weight, bias):
        CountingKernels.calls += 1
        return F.linear(x, weight.dequantize(x.dtype), bias)

    def norm_linear(self, x, residual, norm_weight, eps, weight, bias):
        CountingKernels.norm_calls += 1
        h = x if residual is None else x + residual
        normed = TorchOps().rms_norm(h, norm_weight, eps)
        return F.linear(normed, weight.dequantize(x.dtype), bias), normed, h


@hookimpl
def xinfer_weight_formats():
    return {"int8-rows": f"{__name__}:Int8Rows"}


def test_a_plugin_format_registers_through_the_hook_and_brings_its_kernels(monkeypatch) -> None:
    found = registry.discover(["cpu"], modules={"int8-rows": sys.modules[__name__]})
    monkeypatch.setattr(registry, "discovery", lambda: found)
    fmt = get_weight_format("int8-rows")
    assert isinstance(fmt, Int8Rows) and "q4_k" in registry.weight_formats()
    values = torch.randn(8, 64)
    weight = quantized(fmt.quantize(values), fmt, (8, 64))
    x = torch.randn(2, 64)
    with ops.use(CpuOps()):
        got = ops.linear(x, weight)
    assert CountingKernels.calls == 1
    torch.testing.assert_close(got, x @ weight.dequantize().T)
    assert relative_error(weight.dequantize(), values) <= 1 / 127
    with ops.use(TorchOps()):  # no kernels under the reference backend's name: the reference
        ops.linear(x, weight)
    assert CountingKernels.calls == 1


def test_a_formats_norm_linear_kernel_runs_the_norm_and_its_linear(monkeypatch) -> None:
    """ops.norm_linear over a format whose kernels have a norm_linear runs it (as one op: a backend may prepare the
    activations in the norm's pass); a weight in parts runs its first part's, the other parts multiplying the normed
    rows; a first part, or a backend, without such a kernel gets the norm and then the linear."""
    found = registry.discover(["cpu"], modules={"int8-rows": sys.modules[__name__]})
    monkeypatch.setattr(registry, "discovery", lambda: found)
    fmt = get_weight_format("int8-rows")
    weight = quantized(fmt.quantize(torch.randn(8, 64)), fmt, (8, 64))
    x, residual, norm_weight, bias = torch.randn(2, 64), torch.randn(2, 64), torch.rand(64) + 0.5, torch.randn(8)
    h = x + residual
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weight
    want = normed @ weight.dequantize().T + bias
    CountingKernels.norm_calls = 0
    with ops.use(CpuOps()):
        y, got_normed, got_h = ops.norm_linear(x, residual, norm_weight, 1e-6, weight, bias)
    assert CountingKernels.norm_calls == 1
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(got_normed, normed)
    torch.testing.assert_close(got_h, h)
    merged = cat_rows([weight, packed("q8_0", (32, 64), seed=1)])
    with ops.use(CpuOps()):
        y, got_normed, got_h = ops.norm_linear(x, residual, norm_weight, 1e-6, merged, torch.ones(40))
    assert CountingKernels.norm_calls == 2  # in parts: the first part's kernel, then the other part's linear
    torch.testing.assert_close(y, normed @ merged.dequantize().T + 1, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got_normed, normed)
    torch.testing.assert_close(got_h, h)
    merged = cat_rows([packed("q8_0", (32, 64), seed=1), weight])
    with ops.use(CpuOps()):
        y, _, _ = ops.norm_linear(x, residual, norm_weight, 1e-6, merged)
    assert CountingKernels.norm_calls == 2  # a first part without the kernel: the norm, then each part's linear
    torch.testing.assert_close(y, normed @ merged.dequantize().T, rtol=2e-2, atol=2e-2)
    with ops.use(TorchOps()):
        y, _, _ = ops.norm_linear(x, None, norm_weight, 1e-6, weight, bias)
    assert CountingKernels.norm_calls == 2
    torch.testing.assert_close(y, TorchOps().rms_norm(x, norm_weight, 1e-6) @ weight.dequantize().T + bias)

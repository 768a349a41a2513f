"""Files llama.cpp's own quantizer writes (``llama_model_quantize``: its K-quant mixes, as users download them),
read by xinfer (Llama; Qwen2's biases and Qwen3's norms and tied table in two mixes): the reference path gives
transformers' logits of the same file, and every weight the CPU backend repacks gives the reference's products
and rows. Covers every K type with the scales and mins llama.cpp's own quantizer chooses."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from tests.llama_cpp_oracle import llama_cpp_module
from tests.loading.gguf_models import reference_llm
from tests.loading.test_gguf import write_gguf
from tests.plugins.hf_parity import randomize
from tests.quant.test_seam import relative_error
from tests.tiny_models import COMMON, prefill_logits, prompt
from xinfer import LLM, ops
from xinfer.layers.linear import Linear
from xinfer.loading.gguf_file import GGUFFile
from xinfer.quant import QuantizedTensor
from xinfer_cpu.ops import CpuOps
from xinfer_cpu.quant import WEIGHT_KERNELS

T = gguf.GGMLQuantizationType
# K-quant rows are whole 256-value blocks: hidden 256, intermediate 512
CONFIG = dict(COMMON, hidden_size=256, intermediate_size=512, vocab_size=512, initializer_range=0.2, bos_token_id=1,
              eos_token_id=2)  # fmt: skip
ARCHITECTURES = {
    "llama": lambda: LlamaConfig(**CONFIG, tie_word_embeddings=False),
    "qwen2": lambda: Qwen2Config(**CONFIG, tie_word_embeddings=False),  # q/k/v biases
    # q/k norms; the table tied to the head, in the type llama.cpp picks for it (transformers reads a Qwen3 GGUF
    # with the default head_dim, 128)
    "qwen3": lambda: Qwen3Config(**{**CONFIG, "num_attention_heads": 2, "num_key_value_heads": 1}, head_dim=128,
                                 tie_word_embeddings=True),
}  # fmt: skip
# each mix and the block types llama.cpp writes for it at this size
MIXES = {
    "Q2_K": {T.Q2_K, T.Q3_K, T.Q6_K},
    "Q3_K_M": {T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K},
    "Q4_K_M": {T.Q4_K, T.Q6_K},
    "Q5_K_M": {T.Q5_K, T.Q6_K},
    "Q4_1": {T.Q4_1, T.Q6_K},
    "Q5_1": {T.Q5_1, T.Q6_K},
}
CASES = [("llama", mix) for mix in MIXES] + [(arch, mix) for arch in ("qwen2", "qwen3") for mix in ("Q3_K_M", "Q5_K_M")]
# the repack's bf16 scales and zeros (and a product's bf16 activations): within a few 2^-9 of the exact values
BF16_TOLERANCE = 2**-7


@pytest.fixture(scope="module")
def f32_ggufs(tmp_path_factory) -> Callable[[str], Path]:
    """A tiny model of an architecture with random norms and biases, every tensor F32 (written once)."""

    @functools.cache
    def written(arch: str) -> Path:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(ARCHITECTURES[arch]()).float()
        randomize(model)
        path = tmp_path_factory.mktemp(f"{arch}-f32") / "f32.gguf"
        write_gguf(model, arch, path, storage=lambda _: T.F32)
        return path

    return written


@pytest.fixture(scope="module", params=CASES, ids=["-".join(case) for case in CASES])
def quantized_file(request, f32_ggufs) -> tuple[str, Path]:
    llama_cpp = llama_cpp_module()
    arch, mix = request.param
    source = f32_ggufs(arch)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{mix}")
    path = source.with_name(f"{mix}.gguf")
    assert llama_cpp.llama_model_quantize(str(source).encode(), str(path).encode(), ctypes.byref(params)) == 0
    return mix, path


def test_the_reference_path_gives_transformers_logits_of_llama_cpps_file(quantized_file):
    mix, path = quantized_file
    stored = {info.ggml_type for info in GGUFFile(path).tensors.values()}
    assert stored - {T.F32} == MIXES[mix]
    llm = reference_llm(path, dtype="float32", device="cpu", num_blocks=64)
    linears = [m for m in llm.engine.model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.weight, QuantizedTensor) for m in linears)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ids = prompt(29, vocab_size=CONFIG["vocab_size"])
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
    got = prefill_logits(llm.engine, ids)
    error = ((got - expected).abs().max(-1).values / expected.abs().max(-1).values).max()
    assert error <= 1e-4, f"{mix}: max|diff|/max|HF logit| = {error:.2e} (worst position)"


def test_every_weight_the_cpu_repacks_gives_the_reference_products_and_rows(quantized_file):
    mix, path = quantized_file
    fast = LLM(model=str(path), dtype="float32", device="cpu", num_blocks=64)
    stored = dict(reference_llm(path, dtype="float32", device="cpu", num_blocks=64).engine.model.named_parameters())
    x = torch.randn(5, CONFIG["intermediate_size"], generator=torch.Generator().manual_seed(0))
    checked = set()
    for name, weight in fast.engine.model.named_parameters():
        if not isinstance(weight, QuantizedTensor):
            continue
        for part, original in zip(weight.parts or (weight,), stored[name].parts or (stored[name],)):
            if original.format.name not in WEIGHT_KERNELS:
                continue
            assert part.format.name.startswith(f"{original.format.name}:cpu-int4"), f"{mix}: {name} not repacked"
            rows = x[:, : part.logical_shape[1]]
            with ops.use(CpuOps()):
                got = ops.linear(rows, part)
            assert relative_error(got, rows @ original.dequantize().T) <= BF16_TOLERANCE, f"{mix}: {name}"
            index = torch.tensor([0, part.logical_shape[0] - 1, 37])  # rows read back (a tied table's lookups)
            assert relative_error(part.dequantize_rows(index), original.dequantize()[index]) <= BF16_TOLERANCE, (
                f"{mix}: {name}"
            )
            checked.add(original.format.name)
    assert checked == {fmt.name.lower() for fmt in MIXES[mix]} & set(WEIGHT_KERNELS)

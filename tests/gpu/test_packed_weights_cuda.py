"""Packed weights on the GPU: a float checkpoint quantized at load (--isq) runs on the cuda backend, CUDA
graphs included, and gives the logits of the same packed weights on the CPU's reference path. Runs on the GPU
machine (qkern's kernels, once registered in CudaOps.weight_kernels, run here instead of the reference)."""

import pytest
import torch
from transformers import LlamaConfig

from tests.tiny_models import COMMON, prefill_logits, prompt, save_tiny_model
from xinfer import LLM, SamplingParams
from xinfer.quant import QuantizedTensor, WeightKernels
from xinfer_cpu.ops import CpuOps
from xinfer_cuda.fp8_tensor_cores import Fp8TensorCores

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device; benchmarks/gpu_suite.py runs it on the GPU machine"
)

# 256-wide rows: whole blocks of the K formats
SHAPE = {**COMMON, "hidden_size": 256, "intermediate_size": 512, "initializer_range": 0.2}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama-256")
    save_tiny_model(LlamaConfig(**SHAPE, architectures=["LlamaForCausalLM"]), folder)
    return str(folder)


SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
FP8_TENSOR_CORES = pytest.param(
    "fp8", "tensor-cores", None, marks=pytest.mark.skipif(not SM90, reason="FP8 tensor cores: SM90 only")
)


class Fp8Activations(WeightKernels):
    """The CPU reference of FP8 on the tensor cores: rows of more than one token rounded to e4m3 per token and 128
    columns (each group's largest magnitude to 448, as DeepSeek's and vLLM's block-scaled FP8 does), then times the
    weight. Against the float reference a 2-layer random model's logits move by ~15 % of the largest (H100): e4m3
    keeps 3 bits of mantissa."""

    @staticmethod
    def linear(x: torch.Tensor, weight: QuantizedTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        if rows.shape[0] > 1:  # one row: the GEMV over the same bytes, the activations as they are
            groups = rows.unflatten(-1, (-1, 128))
            scales = groups.abs().amax(-1, keepdim=True).clamp_min(1e-12) / torch.finfo(torch.float8_e4m3fn).max
            rows = ((groups / scales).to(torch.float8_e4m3fn).float() * scales).flatten(-2)
        y = rows @ weight.dequantize().float().T + (0 if bias is None else bias.float())
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)


FP8_ACTIVATIONS = Fp8Activations()


@pytest.mark.parametrize(
    "isq, fp8_matmul, tolerance",
    [
        (isq, "weight-only", 1e-3)
        for isq in ("q8_0", "q4_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "fp8", "mxfp4", "nvfp4")
    ]
    + [FP8_TENSOR_CORES],
)
def test_isq_on_cuda_matches_the_cpu_reference(model_dir, isq, fp8_matmul, tolerance, monkeypatch):
    monkeypatch.setenv("XINFER_FP8_MATMUL", fp8_matmul)
    gpu = LLM(model=model_dir, dtype="float32", device="cuda", isq=isq, num_blocks=64, max_num_seqs=4)  # few captures
    assert isinstance(gpu.engine.model.model.layers[0].mlp.down_proj.weight, QuantizedTensor)
    tensor_cores = fp8_matmul == "tensor-cores"
    monkeypatch.setattr(CpuOps, "weight_kernels", {"fp8": f"{__name__}:FP8_ACTIVATIONS"} if tensor_cores else {})
    cpu = LLM(model=model_dir, dtype="float32", device="cpu", isq=isq, num_blocks=64)
    cpu_weights = dict(cpu.engine.model.named_parameters())
    for name, weight in gpu.engine.model.named_parameters():
        if isinstance(weight, QuantizedTensor):
            adopt_near_ties(name, weight, cpu_weights[name])
    ids = prompt(37)
    if tensor_cores:
        each_linear_matches_on_its_inputs(gpu, cpu_weights, ids, monkeypatch)
        return
    got, expected = prefill_logits(gpu.engine, ids).cpu(), prefill_logits(cpu.engine, ids)
    error = float((got - expected).abs().max() / expected.abs().max())
    assert error <= tolerance, f"{isq}: max|diff|/max|logit| = {error:.2e}"
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [prompt(n, seed=n) for n in (3, 20, 41)]
    gpu_tokens = [o.outputs[0].token_ids for o in gpu.generate(prompts, params)]  # decode replays CUDA graphs
    cpu_tokens = [o.outputs[0].token_ids for o in cpu.generate(prompts, params)]
    assert sum(a[:4] == b[:4] for a, b in zip(gpu_tokens, cpu_tokens)) >= 2


def adopt_near_ties(name: str, gpu_weight: QuantizedTensor, cpu_weight: QuantizedTensor) -> None:
    """The same values packed on both devices, so that a difference in the logits is the kernels', not the
    quantizer's. A K-quant's fit may pick the other of two candidates whose errors tie within float rounding (one
    Q5_K block of the 320-row embedding on an H100, 2026-12-07: its weighted errors summed alike, one elementwise
    rounding apart): at most 1 % of the rows may differ, and the CPU then takes the GPU's bytes."""
    ours, theirs = gpu_weight.dequantize().cpu(), cpu_weight.dequantize()
    rows = (ours != theirs).flatten(1).any(1)
    if not rows.any():
        return
    assert int(rows.sum()) <= max(1, rows.numel() // 100), f"{name}: {int(rows.sum())} rows packed differently"
    assert gpu_weight.format.name == cpu_weight.format.name, f"{name}: packed differently, in another layout"
    cpu_weight.raw.copy_(gpu_weight.raw.cpu())


def each_linear_matches_on_its_inputs(gpu: LLM, cpu_weights: dict, ids: list[int], monkeypatch) -> None:
    """FP8 on the tensor cores rounds the activations to e4m3 per 128 columns: a last-bit difference upstream (the
    GPU's attention and norms round differently from the CPU's) moves a group's scale and re-rounds its 128 values,
    so a 2-layer random model's logits end ~17 % of the largest from any CPU emulation, as far as from the float
    ones (H100, 2026-12-07; each linear alone within 1e-3 of it). So each FP8 linear of a prefill is checked
    against the CPU's emulation on the very inputs the GPU gave it."""
    names = {w.data_ptr(): name for name, w in gpu.engine.model.named_parameters()}
    calls: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    original = Fp8TensorCores.linear

    def recorded(self, x, weight, bias=None):
        y = original(self, x, weight, bias)
        calls.append((names[weight.data_ptr()], x.cpu(), y.cpu()))
        return y

    monkeypatch.setattr(Fp8TensorCores, "linear", recorded)
    prefill_logits(gpu.engine, ids)
    linears = {n for n, w in cpu_weights.items() if isinstance(w, QuantizedTensor) and "embed_tokens" not in n}
    assert {name for name, _, _ in calls} >= linears
    for name, x, y in calls:
        expected = FP8_ACTIVATIONS.linear(x, cpu_weights[name])
        error = float((y - expected).abs().max() / expected.abs().max())
        assert error <= 3e-3, f"{name}: max|diff|/max = {error:.2e} on the GPU's own input"

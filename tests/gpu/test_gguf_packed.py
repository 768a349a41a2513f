"""End to end on the GPU: a tiny Llama GGUF whose weights stay packed in several GGUF block
formats gives, through the CUDA backend's packed-weight kernels (CUDA graphs and eager), the
greedy tokens of the reference (the CPU backend dequantizing per call, in fp32: not its repacked
matmuls, whose bf16 activations and scales move these logits by up to 4 % of the largest). Runs on
the GPU machine; the kernels themselves are checked under the interpreter
(tests/backends/test_gguf_kernels.py, tests/backends/test_gguf_planes.py)."""

from pathlib import Path

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.loading.gguf_models import reference_llm
from tests.loading.test_gguf import write_gguf
from tests.tiny_models import COMMON, prefill_logits, prompt
from xinfer import LLM, SamplingParams
from xinfer.quant import QuantizedTensor

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device; benchmarks/gpu_suite.py runs it on the GPU machine"
)

T = gguf.GGMLQuantizationType
# every K-quant row a whole 256-value block: hidden 256, intermediate 512
CONFIG = dict(COMMON, hidden_size=256, intermediate_size=512, initializer_range=0.2, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2)  # fmt: skip
# (Q2_K, Q3_K and Q5_K have no quantizer here, in the gguf package or the core: kernel tests only)
STORAGE = {"q_proj": T.Q4_K, "k_proj": T.Q4_0, "v_proj": T.Q6_K, "o_proj": T.Q8_0, "gate_proj": T.Q4_1,
           "up_proj": T.Q5_0, "down_proj": T.Q5_1, "lm_head": T.Q6_K, "embed": T.Q8_0}  # fmt: skip
PROMPTS = [prompt(n, seed=n) for n in (1, 5, 17, 40, 63, 100)]


def storage(hf_name: str) -> gguf.GGMLQuantizationType:
    return next((qtype for part, qtype in STORAGE.items() if part in hf_name), T.F32)


@pytest.fixture(scope="module")
def packed_gguf(tmp_path_factory):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG, architectures=["LlamaForCausalLM"])).float()
    path = tmp_path_factory.mktemp("packed") / "tiny.gguf"
    write_gguf(model, "llama", path, storage=storage)
    return str(path)


def tokens(llm, params):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_packed_gguf_gives_the_cpu_reference_tokens(packed_gguf, enforce_eager):
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    cpu = reference_llm(Path(packed_gguf), dtype="float32", device="cpu", num_blocks=128)
    gpu = LLM(model=packed_gguf, dtype="float32", device="cuda", num_blocks=128, max_num_seqs=8,
              enforce_eager=enforce_eager)  # fmt: skip
    packed = [p for p in gpu.engine.model.parameters() if isinstance(p, QuantizedTensor)]
    formats = {q.format.name for p in packed for q in (p.parts or (p,))}  # merged q/k/v and gate/up: in parts
    # every linear re-laid into the CUDA backend's planes (the embedding's Q8_0 rows stay the file's)
    planes = {f"{name}:cuda-planes" for name in ("q4_k", "q4_0", "q6_k", "q8_0", "q4_1", "q5_0", "q5_1")}
    assert formats == planes | {"q8_0"}
    for ids in PROMPTS[:3]:  # fp32 on both: apart by summation order alone (3.5e-6 with the kernels interpreted)
        got, expected = prefill_logits(gpu.engine, ids).cpu(), prefill_logits(cpu.engine, ids)
        error = float((got - expected).abs().max() / expected.abs().max())
        assert error <= 1e-4, f"{len(ids)} tokens: max|diff|/max|logit| = {error:.2e}"
    assert tokens(gpu, params) == tokens(cpu, params)

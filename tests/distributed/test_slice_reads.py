"""Under tensor parallelism each rank reads from the safetensors files only the slice of a split tensor
it keeps, and whole only the tensors every rank holds: the bytes the file hands out are counted for
each kind of split (column, row, vocab rows padded past an odd vocabulary, q/k/v and gate/up merged
from their own tensors or from the checkpoint's merged ones, experts, latent attention's up-projection,
Gated DeltaNet's projections, convolution and per-head parameters). Both ranks are built in this
process (loading runs no collective); what they load must equal the rank's part of the whole tensors
(the end-to-end tokens are tests/distributed/test_tensor_parallel.py's)."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import LlamaConfig, Phi3Config

import xinfer.loading.safetensors as safetensors_module
from tests.plugins.deepseek.configs import deepseek_v3_config
from tests.plugins.hf_parity import randomize
from tests.plugins.qwen.test_qwen3_next import CONFIGS as HYBRID_CONFIGS
from tests.plugins.qwen.test_qwen_moe import CONFIGS as MOE_CONFIGS
from tests.quant.test_quantized_checkpoint import BLOCKS, ROWS, write_fp8_checkpoint
from tests.tiny_models import COMMON, save_tiny_model
from xinfer.distributed.group import Slice, TensorParallel, building_for
from xinfer.loading.loader import build_model, load_config, load_model
from xinfer.loading.stored import StoredTensor
from xinfer.model import finish_loading

CPU, FP32 = torch.device("cpu"), torch.float32
CONFIGS = {
    # odd vocabulary: the second rank's rows end past it; q/k/v and gate/up from their own tensors
    "llama": lambda: LlamaConfig(**{**COMMON, "vocab_size": 321}, architectures=["LlamaForCausalLM"]),
    "phi3": lambda: Phi3Config(**COMMON, architectures=["Phi3ForCausalLM"]),  # the checkpoint's merged qkv, gate_up
    "qwen3-moe": MOE_CONFIGS["qwen3-moe"],  # experts one tensor each
    "deepseek-v3": deepseek_v3_config,  # latent attention's kv_b_proj, shared experts
    "qwen3.5": HYBRID_CONFIGS["qwen3.5"],  # Gated DeltaNet, gated attention
}
# The checkpoint tensors a rank holds a part of; every other one it holds whole.
SPLIT = re.compile(
    r"(embed_tokens|lm_head|[qkv]_proj|qkv_proj|o_proj|q_b_proj|kv_b_proj|gate_proj|up_proj|gate_up_proj|down_proj"
    r"|in_proj_(qkv|z|a|b)|conv1d|out_proj)\.(weight|bias)$|\.(A_log|dt_bias)$"
)
ROW_BIAS = re.compile(r"(o_proj|down_proj|out_proj)\.bias$")  # added once, after the sum over the ranks


class CountingFile:
    """A safetensors file that counts the bytes of every tensor it hands out, by name."""

    def __init__(self, path: str, framework: str, device: str, read: dict[str, int]):
        self.file, self.read = safe_open(path, framework=framework, device=device), read

    def keys(self) -> list[str]:
        return self.file.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.counted(name, self.file.get_tensor(name))

    def get_slice(self, name: str):
        reader, counted = self.file.get_slice(name), self.counted

        class Slice:
            get_shape, get_dtype = reader.get_shape, reader.get_dtype

            def __getitem__(self, index):
                return counted(name, reader[index])

        return Slice()

    def counted(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        self.read[name] = self.read.get(name, 0) + tensor.numel() * tensor.element_size()
        return tensor


@pytest.mark.parametrize(
    "part",
    [
        Slice(0, ((2, 4), (6, 7))),  # two ranges of rows
        Slice(-1, ((1, 3),)),  # columns
        Slice(1, ((0, 2), (3, 5))),  # the middle dim of a stack
        Slice(0, ((4, 8),), length=6),  # rows past the end: zeros
    ],
)
def test_a_stored_tensor_reads_the_slice_safetensors_would_cut_from_the_whole(part, tmp_path):
    whole = torch.randn(8, 6, 5)
    save_file({"w": whole}, tmp_path / "w.safetensors")
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as file:
        stored = StoredTensor(file, "w", (lambda t: t * 2,))
        assert (stored.shape, stored.dtype) == (whole.shape, torch.float32)
        pieces = [whole.narrow(part.dim, start, stop - start) for start, stop in part.ranges]
        expected = torch.cat(pieces, part.dim)
        if part.length:
            shape = list(expected.shape)
            shape[part.dim] = part.length - expected.shape[part.dim]
            expected = torch.cat([expected, expected.new_zeros(shape)], part.dim)
        torch.testing.assert_close(stored.read(part), expected * 2, rtol=0, atol=0)
        torch.testing.assert_close(stored.read(), whole * 2, rtol=0, atol=0)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_model(CONFIGS[request.param](), folder)
    randomize(hf)  # biases and norms that differ from their initial values
    hf.save_pretrained(folder, safe_serialization=True)
    return folder, {name: tensor.detach() for name, tensor in hf.state_dict().items()}


def load_rank(folder, rank: int, monkeypatch, read: dict[str, int]):
    monkeypatch.setattr(safetensors_module, "safe_open", lambda *a, **k: CountingFile(*a, **k, read=read))
    with building_for(TensorParallel(rank=rank, size=2)):
        return load_model(folder, load_config(folder), CPU, FP32, "safetensors")


def test_each_rank_reads_only_the_slices_it_keeps(checkpoint, monkeypatch):
    folder, _ = checkpoint
    with safe_open(str(folder / "model.safetensors"), framework="pt") as file:
        stored = {name: file.get_tensor(name).numel() * file.get_tensor(name).element_size() for name in file.keys()}  # noqa: SIM118
    reads: list[dict[str, int]] = [{}, {}]
    for rank in (0, 1):
        load_rank(folder, rank, monkeypatch, reads[rank])
    assert set(reads[0]) | set(reads[1]) <= set(stored)
    split = [name for name in stored if SPLIT.search(name) and not ROW_BIAS.search(name)]
    assert split, "the checkpoint has split tensors"
    for name, size in stored.items():
        got = (reads[0].get(name, 0), reads[1].get(name, 0))
        if name in split:
            assert sum(got) == size and max(got) < size, f"{name}: the ranks read {got} of its {size} bytes"
        elif name in reads[0]:
            assert got == (size, size), f"{name}: the ranks read {got} of its {size} bytes (held whole)"


def test_what_a_rank_reads_is_its_part_of_the_whole_tensors(checkpoint, monkeypatch):
    """The slices read give the same parameters as the whole tensors in memory, sliced there."""
    folder, tensors = checkpoint
    for rank in (0, 1):
        sliced = dict(load_rank(folder, rank, monkeypatch, {}).state_dict())
        with building_for(TensorParallel(rank=rank, size=2)):
            model = build_model(load_config(folder), CPU, FP32)
            model.load_weights(tensors.items())
            finish_loading(model)
        for name, expected in model.state_dict().items():
            torch.testing.assert_close(sliced[name], expected, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    ("name", "quantization"), [("llama", BLOCKS), ("llama", ROWS), ("qwen3-moe", BLOCKS)],
    ids=["fp8-blocks", "compressed-tensors-rows", "fp8-experts"],
)  # fmt: skip
def test_a_quantized_checkpoint_loads_each_ranks_part_of_its_values(name, quantization, tmp_path):
    """FP8 weights and their block (or row) scales are read whole and decoded, then the rank keeps its part:
    that of the float checkpoint the FP8 values and scales stand for."""
    hf = save_tiny_model(CONFIGS[name](), tmp_path / "float")
    randomize(hf)
    write_fp8_checkpoint(hf, tmp_path, quantization)
    for rank in (0, 1):
        with building_for(TensorParallel(rank=rank, size=2)):
            fp8 = load_model(tmp_path, load_config(tmp_path), CPU, FP32, "safetensors").state_dict()
            meant = load_model(tmp_path / "float", load_config(tmp_path / "float"), CPU, FP32, "safetensors")
        for param, expected in meant.state_dict().items():
            torch.testing.assert_close(fp8[param], expected, msg=param)

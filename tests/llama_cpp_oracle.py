"""llama.cpp itself (llama-cpp-python) on a GGUF file, the reference for how its converter's tensors and metadata
are meant: its logits at every prompt position and its greedy tokens, against xinfer's on the same file.

Every weight F32 and the KV cache F32, llama.cpp computes in fp32 on the CPU, so the two agree to fp32 rounding.
"""

from __future__ import annotations

import unittest.mock
from pathlib import Path

import pytest
import torch

from tests.tiny_models import prefill_logits, prompt
from xinfer import LLM, SamplingParams

NEW_TOKENS = 8
_GGML_TYPE_F32 = 0


def llama_cpp_module():
    """llama-cpp-python, or a skip saying why there is none (the README's test command installs it)."""
    return pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: pip install llama-cpp-python")


def llama_cpp_llama(path: Path, **options):
    """llama.cpp's ``Llama`` of ``path`` with its plain CPU kernels: without the extra buffer types (AMX and the
    repacked layouts, which change only speed; on a Sapphire Rapids CPU llama-cpp-python 0.3.36's AMX matmul
    crashes in embedding mode, SIGSEGV in ``ggml_backend_amx_mul_mat``), or a skip saying why there is none."""
    llama_cpp = llama_cpp_module()
    low_level = llama_cpp.llama_cpp  # (the bindings the high-level Llama calls)
    defaults = low_level.llama_model_default_params

    def plain_params():
        params = defaults()
        params.use_extra_bufts = False
        return params

    with unittest.mock.patch.object(low_level, "llama_model_default_params", plain_params):
        return llama_cpp.Llama(model_path=str(path), verbose=False, **options)


def llama_cpp_model(path: Path, n_ctx: int = 128):
    """llama.cpp's model of ``path`` (one thread, every position's logits), or a skip saying why there is none."""
    return llama_cpp_llama(
        path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=1, n_threads_batch=1, logits_all=True,
        type_k=_GGML_TYPE_F32, type_v=_GGML_TYPE_F32,
    )  # fmt: skip


def llama_cpp_logits(model, tokens: list[int]) -> torch.Tensor:
    """llama.cpp's logits at every position of ``tokens`` [T, V], from an empty cache."""
    model.reset()
    model.eval(tokens)
    return torch.from_numpy(model.scores[: len(tokens)].copy())


def llama_cpp_greedy(model, tokens: list[int], new_tokens: int) -> list[int]:
    model.reset()
    model.eval(tokens)
    chosen: list[int] = []
    for _ in range(new_tokens):
        chosen.append(int(model.scores[model.n_tokens - 1].argmax()))
        model.eval(chosen[-1:])
    return chosen


def assert_llama_cpp_agrees(llm: LLM, path: Path, length: int = 29, tolerance: float = 1e-4, n_ctx: int = 128) -> None:
    """xinfer's logits at every position of a random prompt, and its greedy tokens, are llama.cpp's on ``path``
    (``tolerance``: of the largest difference at a position, relative to the largest logit there; ``n_ctx``:
    llama.cpp's context, which it pads to a multiple of 256)."""
    model = llama_cpp_model(path, n_ctx)
    tokens = prompt(length, vocab_size=model.n_vocab())
    expected = llama_cpp_logits(model, tokens)
    got = prefill_logits(llm.engine, tokens)
    error = ((got - expected).abs().max(dim=-1).values / expected.abs().max(dim=-1).values).max()
    assert error <= tolerance, f"max|diff|/max|llama.cpp logit| = {error:.2e} (worst position)"
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ours = llm.generate([tokens], params)[0].outputs[0].token_ids
    assert ours == llama_cpp_greedy(model, tokens, NEW_TOKENS)


def llama_cpp_quantized(values: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """llama.cpp's own quantizer (``ggml_quantize_chunk``, no importance matrix: the reference quantizers its
    ``llama-quantize`` uses) of float32 rows [N, K]: the blocks' bytes [N, K / block values * block bytes]."""
    import ctypes

    llama_cpp = llama_cpp_module()
    ggml = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    ggml.ggml_quantize_chunk.restype = ctypes.c_size_t
    ggml.ggml_quantize_chunk.argtypes = (
        [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p]
    )
    ggml.ggml_row_size.restype = ctypes.c_size_t
    ggml.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    rows, k = values.shape
    source = values.float().contiguous()
    out = torch.empty(rows, ggml.ggml_row_size(ggml_type, k), dtype=torch.uint8)
    ggml.ggml_quantize_init(ggml_type)
    written = ggml.ggml_quantize_chunk(ggml_type, source.data_ptr(), out.data_ptr(), 0, rows, k, None)
    assert written == out.numel()
    return out

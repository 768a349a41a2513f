"""GGUF tokenizer metadata the real models do not exercise, against llama.cpp's own reading of the same file."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from xinfer.text.tokenizer import Tokenizer

# GPT-2's printable spelling of the bytes a byte-level BPE vocabulary starts from
_BYTES = [
    chr(b) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255 else None for b in range(256)
]  # fmt: skip
_ALPHABET = [c if c is not None else chr(256 + sum(x is None for x in _BYTES[:b])) for b, c in enumerate(_BYTES)]
# tokens whose merges the vocabulary holds: they straddle where the pre-tokenizers split differently
_WORDS = [
    "Ġworld", "Hello", "ĠHello", "World", "HelloWorld", "123", "1234", "12", "34", "Ġ1", "Ġ12", "ĊĊ", "ĠĠ", "ĠĠĠ",
    "'s", "'S", "!!", ".Ċ", "Ġ!", "ab", "cd", "ĠThe", "The", "ä¸Ń", "æĸĩ", "ĠÃ©", "Ã©", "ca", "fÃ©", "::",  # noqa: RUF001
]  # fmt: skip
TEXTS = [
    "Hello world", "HelloWorld  hello", "1234567 12 34", "a\n\nb\n", "  leading", "it's IT'S", "wow!!\n.\n",
    "中文 and 日本語", "café Éclair", "x::y", " !! ", "", "   ", "The\tThe\r\nThe", "abcd", "MixedCASEWords",
]  # fmt: skip


def _merges(words: list[str]) -> list[str]:
    """Merges that build each word left to right, one character at a time."""
    merges: list[str] = []
    for word in words:
        for end in range(2, len(word) + 1):
            merge = f"{word[: end - 1]} {word[end - 1]}"
            if merge not in merges:
                merges.append(merge)
    return merges


def write_vocab(path: Path, model: str = "gpt2", pre: str | None = None, extra: dict[str, int] | None = None) -> Path:
    """A vocabulary-only GGUF: the 256 byte tokens, ``_WORDS`` and their prefixes, and ``abcd``, which only
    ``ignore_merges`` reaches (no merge joins ``ab`` and ``cd``)."""
    merges = _merges(_WORDS)
    tokens = [*_ALPHABET, *dict.fromkeys(m.replace(" ", "") for m in merges), "abcd", "<|bos|>", "<|eos|>"]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    writer.add_token_merges(merges)
    for key, token_id in (extra or {}).items():
        writer.add_uint32(f"tokenizer.ggml.{key}", token_id)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama_cpp_vocab(path: Path):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the oracle)")
    return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


PRES = ["llama-bpe", "qwen2", "qwen35", "deepseek-v3", "glm4", "chatglm-bpe", "gpt-4o", "minimax-m2", "tekken",
        "smollm", "gpt-2", "stablelm2", "seed-coder", "deepseek-coder", "falcon-h1", "default", None]  # fmt: skip


@pytest.mark.parametrize("pre", PRES)
def test_byte_level_pre_tokenizers_split_as_llama_cpp(tmp_path, pre):
    path = write_vocab(tmp_path / "vocab.gguf", pre=pre, extra={"bos_token_id": len(_ALPHABET) + 1})
    reference, ours = llama_cpp_vocab(path), Tokenizer.from_gguf(path)
    for text in TEXTS:
        for add_bos in (False, True):
            expected = reference.tokenize(text.encode(), add_bos=add_bos, special=True)
            assert ours.encode(text, add_special_tokens=add_bos) == expected, (text, add_bos)


@pytest.mark.parametrize("pre", ["llama-bpe", "tekken", "qwen2", "gpt-2"])
def test_bos_is_added_by_default_where_llama_cpp_adds_it(tmp_path, pre):
    """Without tokenizer.ggml.add_bos_token llama.cpp adds BOS for Llama 3's and Tekken's pre-tokenizers."""
    path = write_vocab(tmp_path / "vocab.gguf", pre=pre, extra={"bos_token_id": 0})
    expected = llama_cpp_vocab(path).tokenize(b"Hello", add_bos=True, special=True)
    assert Tokenizer.from_gguf(path).encode("Hello") == expected


def test_a_special_token_id_past_the_vocabulary_falls_back_as_in_llama_cpp(tmp_path):
    path = write_vocab(tmp_path / "vocab.gguf", pre="llama-bpe", extra={"bos_token_id": 10**6, "eos_token_id": 10**6})
    expected = llama_cpp_vocab(path).tokenize(b"Hello", add_bos=True, special=True)
    ours = Tokenizer.from_gguf(path)
    assert ours.encode("Hello") == expected
    assert ours.bos_token_id == expected[0] == 11  # llama.cpp's default BOS of a BPE vocabulary

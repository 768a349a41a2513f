"""A ``tokenizers.Tokenizer`` rebuilt from a GGUF file's ``tokenizer.ggml.*`` metadata.

Two vocabulary kinds, following how llama.cpp tokenizes them:

- ``gpt2``: byte-level BPE with the stored merges, split by the pre-tokenizer named in
  ``tokenizer.ggml.pre``.
- ``llama``: SentencePiece BPE. llama.cpp merges the adjacent pair whose joined piece has
  the highest score; a BPE whose merge ranks follow those scores does the same. Characters
  outside the vocabulary fall back to ``<0xNN>`` byte tokens.

Control tokens become special added tokens and user-defined ones plain added tokens: both
are matched whole in the raw text before any normalization, as llama.cpp does. Like llama.cpp,
the tokens that end generation (:func:`end_of_generation_ids`) count as control tokens whatever
type the file gives them (Gemma 3's ``</s>`` is user-defined there).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

log = logging.getLogger(__name__)

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPM_SPACE = "\u2581"
# SentencePiece's byte-fallback pieces: one byte each
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _regex_split(pattern: str) -> tuple[pre_tokenizers.PreTokenizer]:
    return (pre_tokenizers.Split(Regex(pattern), behavior="isolated"),)


# tokenizer.ggml.pre -> the splits llama.cpp applies before byte-level BPE
_PRE_SPLITS: dict[str, tuple[pre_tokenizers.PreTokenizer, ...]] = {
    **dict.fromkeys(("default", "gpt2", "gpt-2", "mpt", "olmo", "jais"), ()),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"),
                    (pre_tokenizers.Digits(individual_digits=True),)),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "pixtral", "dbrx"),
                    _regex_split(_LLAMA3_SPLIT)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _regex_split(_QWEN2_SPLIT)),
}  # fmt: skip


# Texts of the tokens llama.cpp ends generation on, besides the ids the metadata names (llama-vocab.cpp)
_END_OF_GENERATION_TEXTS = frozenset(
    "<|eot_id|> <|im_end|> <|end|> <|return|> <|call|> <|flush|> <|calls|> <end_of_turn> <|endoftext|> </s> "
    "<|eom_id|> <EOT> _<EOT> [EOT] [EOS] <|end_of_text|> <end_of_utterance> <eos> <turn|> <|tool_response> "
    "[e~[ <\uff5cend\u2581of\u2581sentence\uff5c>".split()  # DeepSeek's, in full-width bars
)
# fill-in-the-middle padding, repository and file separator tokens, which end generation too: a metadata id, or else
# the first token spelled one of these ways
_FIM_END_TEXTS = {
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}


def end_of_generation_ids(meta: Mapping[str, Any]) -> set[int]:
    """The tokens llama.cpp stops generating on: EOS, EOT and EOM, the fill-in-the-middle ends, and the tokens
    spelled as a turn or text end."""
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    ids = {i for key in ("eos", "eot", "eom") if (i := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None}
    for key, spellings in _FIM_END_TEXTS.items():
        declared = meta.get(f"tokenizer.ggml.{key}_token_id")
        found = declared if declared is not None else next((i for i, t in enumerate(tokens) if t in spellings), None)
        if found is not None:
            ids.add(found)
    ids |= {i for i, t in enumerate(tokens) if t in _END_OF_GENERATION_TEXTS}
    ends = {tokens[i]: i for i in ids if 0 <= i < len(tokens)}
    # harmony-style vocabularies end a message with <|end|>, a turn with <|return|> or <|call|>
    calls = "<|call|>" in ends or "<|calls|>" in ends
    if "<|end|>" in ends and calls and ("<|return|>" in ends or "<|flush|>" in ends):
        ids.discard(ends["<|end|>"])
    if "</s>" in ends and "<|tool_response>" in ends:  # there </s> is text
        ids.discard(ends["</s>"])
    return {i for i in ids if 0 <= i < len(tokens)}


def build_tokenizer(meta: Mapping[str, Any]) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens))]
    for i in end_of_generation_ids(meta):
        types[i] = CONTROL
    if kind == "gpt2":
        tok = _byte_level_bpe(tokens, list(meta.get("tokenizer.ggml.merges", [])), meta.get("tokenizer.ggml.pre"))
    elif kind == "llama":
        scores = [float(s) for s in meta["tokenizer.ggml.scores"]]
        unk_id = meta.get("tokenizer.ggml.unknown_token_id")
        tok = _sentencepiece_bpe(tokens, scores, types, unk_id, _space_prefix(meta))
    else:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (supported: gpt2, llama)")
    _add_special_tokens(tok, tokens, types)
    return tok


class ByteTokenDecoder:
    """Text of ids as llama.cpp gives it for a vocabulary with byte tokens (``<0xNN>``): the tokens' bytes joined,
    read as UTF-8 with one U+FFFD for each invalid sequence. tokenizers' ByteFallback decoder instead makes every
    byte of a run of byte tokens U+FFFD when any of them is amiss, losing the run's valid characters too (a
    character cut at the run's start, as a stream window or a truncated prompt starts)."""

    def __init__(self, backend: Tokenizer, strip_first_space: bool):
        self.special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self.byte_ids = frozenset(i for piece, i in backend.get_vocab().items() if BYTE_PIECE.fullmatch(piece))
        self.strip_first_space = strip_first_space

    def decode(self, backend: Tokenizer, ids: Sequence[int], skip_special_tokens: bool) -> str:
        skipped = self.special_ids if skip_special_tokens else frozenset()
        pieces = (backend.id_to_token(i) for i in ids if i not in skipped)
        text = b"".join(piece_bytes(p) for p in pieces if p is not None).decode("utf-8", errors="replace")
        return text[1:] if self.strip_first_space and text.startswith(" ") else text


def byte_token_decoder(meta: Mapping[str, Any], backend: Tokenizer) -> ByteTokenDecoder | None:
    """llama.cpp's decoding of the SentencePiece vocabulary ``backend`` was built from, None for byte-level BPE."""
    if meta.get("tokenizer.ggml.model") != "llama":
        return None
    return ByteTokenDecoder(backend, strip_first_space=_space_prefix(meta))


def _space_prefix(meta: Mapping[str, Any]) -> bool:
    return bool(meta.get("tokenizer.ggml.add_space_prefix", True))


def piece_bytes(piece: str) -> bytes:
    """The bytes an SPM piece stands for: a byte token's one byte, else its text with U+2581 as a space."""
    if byte := BYTE_PIECE.fullmatch(piece):
        return bytes([int(byte[1], 16)])
    return piece.replace(SPM_SPACE, " ").encode()


def post_processor(
    bos: str | None, bos_id: int | None, eos: str | None, eos_id: int | None, add_bos: bool, add_eos: bool
) -> processors.TemplateProcessing:
    """``[bos] $A [eos]`` with each end present only when asked for and defined."""
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
    pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
    special = {**({bos: bos_id} if add_bos else {}), **({eos: eos_id} if add_eos else {})}
    return processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(pair), special_tokens=list(special.items())
    )


def _vocab(tokens: Sequence[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a duplicated spelling keeps its first id, like llama.cpp
    return vocab


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str | None) -> Tokenizer:
    pairs = [(left, right) for left, right in (m.split(" ", 1) for m in merges)]
    vocab = _vocab(tokens)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=False))
    splits = _PRE_SPLITS.get(pre or "default")
    if splits is None:
        log.warning("unknown GGUF pre-tokenizer %r; splitting like GPT-2", pre)
        splits = ()
    uses_own_regex = any(isinstance(s, pre_tokenizers.Split) for s in splits)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not uses_own_regex)
    # a byte the vocabulary lacks is dropped, but, as in llama.cpp, no merge joins its two neighbours
    missing = "".join(sorted(c for c in pre_tokenizers.ByteLevel.alphabet() if c not in vocab))
    holes = [pre_tokenizers.Split(Regex(f"[{re.escape(missing)}]"), behavior="removed")] if missing else []
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level, *holes])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(
    tokens: list[str], scores: list[float], types: list[int], unk_id: int | None, space_prefix: bool
) -> Tokenizer:
    unk = tokens[unk_id] if unk_id is not None else None
    model = models.BPE(
        vocab=_vocab(tokens),
        merges=_merges_by_score(tokens, scores, types),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Replace(" ", SPM_SPACE)
    steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        # llama.cpp prefixes a space only to the first piece of text, as Metaspace "first" does
        tok.normalizer = None
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPM_SPACE, prepend_scheme="first", split=False)
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _merges_by_score(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every split of a normal token into two normal tokens, best joined score first."""
    normal = {t for t, kind in zip(tokens, types) if kind == NORMAL}
    ranked: list[tuple[float, int, str, str]] = []
    for i, (piece, kind) in enumerate(zip(tokens, types)):
        if kind != NORMAL or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[i], i, left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]


def _add_special_tokens(tok: Tokenizer, tokens: list[str], types: list[int]) -> None:
    special = [
        AddedToken(t, normalized=False, special=True) for t, kind in zip(tokens, types) if kind in (CONTROL, UNKNOWN)
    ]
    user = [AddedToken(t, normalized=False, special=False) for t, kind in zip(tokens, types) if kind == USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(user)

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
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

log = logging.getLogger(__name__)

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPM_SPACE = "\u2581"
# SentencePiece's byte-fallback pieces: one byte each
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LLAMA3_SPLIT = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35_SPLIT = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK3_SPLITS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",  # CJK ideographs, hiragana, katakana
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_DEEPSEEK_CODER_SPLITS = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}")
# llama.cpp's spelling of upper- and lower-case runs: its regex engine sees a non-ASCII letter as either
_UPPER, _LOWER = r"((?=[\p{L}])([^a-z]))", r"((?=[\p{L}])([^A-Z]))"
_GPT4O_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SEED_CODER_SPLIT = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BAILING_SPLIT = (
    r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp splits text before byte-level BPE for one ``tokenizer.ggml.pre`` (``llama_vocab::load``)."""

    splits: tuple[str, ...] = ()  # regexes applied in turn, each to the pieces of the one before; (): GPT-2's
    ignore_merges: bool = False  # a piece that is a token is that token, whatever the merges say
    add_bos: bool = False  # llama.cpp's default where the file has no tokenizer.ggml.add_bos_token
    bos: bool = True  # False: no BOS token unless the file names one (ChatGLM's)


_GPT2 = PreTokenizer()
# llama.cpp's splits for a file that names no pre-tokenizer, or "default"
_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", "[0-9][0-9][0-9]"))
_LLAMA3 = PreTokenizer((_LLAMA3_SPLIT,), ignore_merges=True, add_bos=True)
_DIGITS_THEN_GPT2 = PreTokenizer((r"\p{N}", _GPT2_SPLIT))
_QWEN2 = PreTokenizer((_QWEN2_SPLIT,))
_GPT4O = PreTokenizer((_GPT4O_SPLIT,))
_DEEPSEEK3 = PreTokenizer(_DEEPSEEK3_SPLITS)

# tokenizer.ggml.pre -> how llama.cpp pre-tokenizes that vocabulary
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _DEFAULT,
    **dict.fromkeys(("gpt2", "gpt-2", "mpt", "olmo", "jais", "phi-2", "jina-es", "jina-de", "gigachat",
                     "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum", "modern-bert", "exaone4", "trillion",
                     "granite-docling"), _GPT2),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"),
                    _DIGITS_THEN_GPT2),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano"), _LLAMA3),
    **dict.fromkeys(("smaug-bpe", "dbrx"), PreTokenizer((_LLAMA3_SPLIT,))),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open",
                     "grok-2"), _QWEN2),
    "qwen35": PreTokenizer((_QWEN35_SPLIT,)),
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), _DEEPSEEK3),
    "deepseek-coder": PreTokenizer(_DEEPSEEK_CODER_SPLITS),
    "chatglm-bpe": PreTokenizer((_LLAMA3_SPLIT,), bos=False),
    **dict.fromkeys(("glm4", "glm5"), PreTokenizer((_LLAMA3_SPLIT,), ignore_merges=True, bos=False)),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O),
    "tekken": PreTokenizer((_TEKKEN_SPLIT,), ignore_merges=True, add_bos=True),
    "seed-coder": PreTokenizer((_SEED_CODER_SPLIT,)),
    **dict.fromkeys(("bailingmoe", "bailingmoe2", "llada-moe"), PreTokenizer((_BAILING_SPLIT,))),
}  # fmt: skip


def pre_tokenizer(meta: Mapping[str, Any]) -> PreTokenizer:
    """llama.cpp's pre-tokenizer of a byte-level BPE vocabulary; its default for a name not known here (which
    llama.cpp refuses: :func:`build_tokenizer` warns)."""
    return PRE_TOKENIZERS.get(meta.get("tokenizer.ggml.pre") or "default", _DEFAULT)


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
    ids = {i for key in ("eot", "eom") if (i := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None}
    if (eos := special_token_id(meta, "eos")) is not None:
        ids.add(eos)
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
        if (pre := meta.get("tokenizer.ggml.pre") or "default") not in PRE_TOKENIZERS:
            log.warning("GGUF pre-tokenizer %r is not supported here; splitting as llama.cpp's default", pre)
        tok = _byte_level_bpe(tokens, list(meta.get("tokenizer.ggml.merges", [])), pre_tokenizer(meta))
    elif kind == "llama":
        scores = [float(s) for s in meta["tokenizer.ggml.scores"]]
        unk_id = special_token_id(meta, "unknown")
        tok = _sentencepiece_bpe(tokens, scores, types, unk_id, _space_prefix(meta))
    else:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (supported: gpt2, llama)")
    _add_special_tokens(tok, tokens, types)
    return tok


# llama.cpp's BOS, EOS and UNK ids of a vocabulary kind whose file names none
_DEFAULT_IDS = {"llama": {"bos": 1, "eos": 2, "unknown": 0}, "gpt2": {"bos": 11, "eos": 11}}


def special_token_id(meta: Mapping[str, Any], name: str) -> int | None:
    """The id llama.cpp gives ``tokenizer.ggml.<name>_token_id`` (bos, eos, unknown): the file's, else the vocabulary
    kind's default; an id past the vocabulary is no token (llama.cpp warns and keeps the default)."""
    n_tokens = len(meta["tokenizer.ggml.tokens"])
    kind = meta.get("tokenizer.ggml.model")
    default = _DEFAULT_IDS.get(kind or "", {}).get(name)
    if name == "bos" and kind == "gpt2" and not pre_tokenizer(meta).bos:
        default = None
    if default is not None and default >= n_tokens:
        default = None
    declared = meta.get(f"tokenizer.ggml.{name}_token_id")
    if declared is None:
        return default
    if not 0 <= int(declared) < n_tokens:
        log.warning("GGUF tokenizer.ggml.%s_token_id %d is past the %d-token vocabulary; using %s",
                    name, declared, n_tokens, default)  # fmt: skip
        return default
    return int(declared)


def adds_bos_by_default(meta: Mapping[str, Any]) -> bool:
    """Whether llama.cpp adds BOS to a prompt when the file has no ``tokenizer.ggml.add_bos_token``: for
    SentencePiece vocabularies, and byte-level BPE ones whose pre-tokenizer says so (Llama 3's, Tekken)."""
    kind = meta.get("tokenizer.ggml.model")
    return kind == "llama" or (kind == "gpt2" and pre_tokenizer(meta).add_bos)


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


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: PreTokenizer) -> Tokenizer:
    pairs = [(left, right) for left, right in (m.split(" ", 1) for m in merges)]
    vocab = _vocab(tokens)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre.ignore_merges))
    splits = [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in pre.splits]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not splits)
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
        # llama.cpp prefixes a space to every piece of text that starts the input or follows a token (a special or
        # user-defined one: the pieces the normalizer sees one by one), even to one that starts with a space
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPM_SPACE), tok.normalizer])
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

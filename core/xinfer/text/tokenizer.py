"""Text <-> token ids for a model, from an HF tokenizer folder or a GGUF file."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers
from transformers import BatchEncoding

from xinfer.loading.errors import ModelFileError, first_line
from xinfer.loading.gguf_file import GGUFFile
from xinfer.text.chat_template import ChatTemplate
from xinfer.text.gguf_vocab import (
    BYTE_PIECE,
    SPM_SPACE,
    ByteTokenDecoder,
    adds_bos_by_default,
    build_tokenizer,
    byte_token_decoder,
    end_of_generation_ids,
    piece_bytes,
    post_processor,
    special_token_id,
)

if TYPE_CHECKING:
    import torch


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE (GPT-2's) writes each byte as a printable character: the printable Latin-1
    bytes as themselves, the other bytes, in order, as the code points from 256 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


_BYTE_LEVEL = _byte_level_alphabet()


def has_tokenizer(path: Path) -> bool:
    """Whether the model at ``path`` (a ``.gguf`` file or an HF folder) comes with a tokenizer xinfer reads."""
    return path.suffix == ".gguf" or (path / "tokenizer.json").is_file()


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus what generation needs: BOS/EOS and the chat template. It answers
    what code written for the HF tokenizer that vLLM's ``get_tokenizer()`` returns asks of one most
    (``tok(text)`` as transformers' ``BatchEncoding``, ``len(tok)``, ``eos_token_id``, ``batch_decode``,
    ``apply_chat_template``, ``convert_ids_to_tokens``, ``get_vocab``)."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens: Mapping[str, str | None],
        extra_eos_ids: Iterable[int] = (),
        chat_template: ChatTemplate | None = None,
        byte_tokens: ByteTokenDecoder | None = None,
        named_templates: Mapping[str, ChatTemplate] | None = None,
    ):
        """``special_tokens``: the special tokens by role (``bos_token``, ``eos_token``, ``pad_token``, ...), as
        templates read them; ``named_templates``: the templates besides the default, by name (``tool_use``)."""
        self.backend = backend
        self.byte_tokens = byte_tokens
        self.special_tokens = dict(special_tokens)
        self.bos_token, self.eos_token, self.pad_token = (
            special_tokens.get(role) for role in ("bos_token", "eos_token", "pad_token")
        )
        self.bos_token_id, self.eos_token_id, self.pad_token_id = (
            _id(backend, t) for t in (self.bos_token, self.eos_token, self.pad_token)
        )
        declared = {self.eos_token_id} | set(extra_eos_ids)
        self.eos_token_ids: set[int] = {i for i in declared if i is not None}
        self.chat_template = chat_template
        self.named_templates = dict(named_templates or {})

    def chat_template_for(self, tools: Sequence[Any] | None) -> ChatTemplate | None:
        """The template a conversation renders with: the one named ``tool_use`` where there are tools and the
        model has one (as transformers chooses), else the default."""
        if tools and "tool_use" in self.named_templates:
            return self.named_templates["tool_use"]
        return self.chat_template

    # -- constructors -------------------------------------------------------------------

    @classmethod
    def from_path(cls, path: str | Path) -> Tokenizer:
        """A ``.gguf`` file or an HF folder."""
        path = Path(path)
        return cls.from_gguf(path) if path.suffix == ".gguf" else cls.from_folder(path)

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        folder = Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json")
        try:
            backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as error:  # noqa: BLE001 - the tokenizers library raises a bare Exception
            raise ModelFileError(f"{folder / 'tokenizer.json'}: not a tokenizer ({first_line(error)})") from None
        config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        specials = {role: _token_text(config.get(role, special_map.get(role))) for role in SPECIAL_TOKEN_ROLES}
        bos, eos = specials["bos_token"], specials["eos_token"]
        # tokenizer.json's post-processor already adds what the model wants; the config's
        # add_bos/add_eos flags only fill in for a tokenizer.json that has none
        if backend.post_processor is None:
            add_bos, add_eos = bool(config.get("add_bos_token", False)), bool(config.get("add_eos_token", False))
            backend.post_processor = post_processor(bos, _id(backend, bos), eos, _id(backend, eos), add_bos, add_eos)
        _mark_special(backend, _configured_special_tokens(config, special_map))
        default, named = _folder_chat_templates(folder, config, specials)
        # generation stops on every EOS the model declares, not only the tokenizer's own
        return cls(backend, specials, declared_eos_ids(folder), default, named_templates=named)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        gguf = GGUFFile(path)
        meta = gguf.metadata
        backend = build_tokenizer(meta)
        tokens = meta["tokenizer.ggml.tokens"]
        bos_id, eos_id = special_token_id(meta, "bos"), special_token_id(meta, "eos")
        pad_id = meta.get("tokenizer.ggml.padding_token_id")
        bos, eos, pad = (
            tokens[i] if i is not None and 0 <= i < len(tokens) else None for i in (bos_id, eos_id, pad_id)
        )
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", adds_bos_by_default(meta)))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        backend.post_processor = post_processor(bos, bos_id, eos, eos_id, add_bos, add_eos)
        specials = {"bos_token": bos, "eos_token": eos, "pad_token": pad}
        origin = f"GGUF metadata of {gguf.path}"
        key = "tokenizer.chat_template"
        source = meta.get(key)
        template = ChatTemplate(source, origin, specials) if source else None
        named = {k.removeprefix(f"{key}."): ChatTemplate(v, origin, specials) for k, v in meta.items()
                 if k.startswith(f"{key}.") and isinstance(v, str)}  # fmt: skip
        decoder = byte_token_decoder(meta, backend)
        return cls(backend, specials, end_of_generation_ids(meta), template, decoder, named_templates=named)

    # -- text <-> ids -------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if "\ufffd" in text and self.byte_tokens is not None:
            return self.byte_tokens.decode(self.backend, ids, skip_special_tokens)
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for, also where they are only part of a character (its text,
        decoded alone, then has U+FFFD in their place), and a SentencePiece word's leading space, which
        decoding it alone strips (``▁Hello``: `` Hello``; the byte piece ``<0x20>``: a space, not nothing)."""
        text = self.decode([token_id], skip_special_tokens=False)
        piece = self.id_to_token(token_id)
        if piece is None:
            return text.encode()
        if BYTE_PIECE.fullmatch(piece):
            return piece_bytes(piece)
        if piece.startswith(SPM_SPACE) and not text.startswith(" "):
            return b" " + text.encode()
        if "\ufffd" in text and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        return text.encode()

    def __call__(
        self, text: str | Sequence[str], add_special_tokens: bool = True, return_tensors: str | None = None
    ) -> BatchEncoding:
        """HF's ``tok(text)``: its ``BatchEncoding`` of ``input_ids`` and ``attention_mask`` (of each text for a
        list of them); ``return_tensors="pt"``: as torch tensors, one text as a batch of one, as HF's."""
        if isinstance(text, str):
            return _encoding(self.encode(text, add_special_tokens), return_tensors)
        rows = [self.encode(t, add_special_tokens) for t in text]
        return BatchEncoding(
            {"input_ids": rows, "attention_mask": [[1] * len(row) for row in rows]}, tensor_type=return_tensors
        )

    def __len__(self) -> int:
        return self.vocab_size

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def apply_chat_template(
        self,
        messages: Sequence[Any],
        add_generation_prompt: bool = True,
        tools: Sequence[Any] | None = None,
        tokenize: bool = True,
        chat_template: str | None = None,
        return_dict: bool = False,
        return_tensors: str | None = None,
        **extra: Any,
    ) -> str | list[int] | torch.Tensor | BatchEncoding:
        """Render with the model's template (or ``chat_template``, a template's source), then, with
        ``tokenize``, encode without adding BOS again (the template writes it where the model wants it): the
        token ids, or with ``return_dict`` their ``BatchEncoding``, as ``tok(text)``'s (HF's default is
        ``return_dict=True`` from transformers 5 on)."""
        template = self.chat_template_for(tools) if chat_template is None else self.template_from(chat_template)
        if template is None:
            raise ValueError("this model has no chat template; use plain prompts")
        text = template.render(messages, add_generation_prompt, tools, **extra)
        if not tokenize:
            return text
        encoding = _encoding(self.encode(text, add_special_tokens=False), return_tensors)
        return encoding if return_dict else encoding["input_ids"]

    def template_from(self, source: str) -> ChatTemplate:
        """A chat template given by its source, with this tokenizer's special tokens."""
        return ChatTemplate(source, "the chat_template argument", self.special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str | None] | None:
        return self.id_to_token(ids) if isinstance(ids, int) else [self.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | list[int | None] | None:
        return self.token_to_id(tokens) if isinstance(tokens, str) else [self.token_to_id(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)


def _encoding(ids: list[int], return_tensors: str | None) -> BatchEncoding:
    """One text's ``BatchEncoding``; as tensors, a batch of one (HF's)."""
    return BatchEncoding(
        {"input_ids": ids, "attention_mask": [1] * len(ids)}, tensor_type=return_tensors, prepend_batch_axis=True
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:
        raise ModelFileError(f"{path}: not valid JSON: {error}") from None


def _token_text(token: str | dict | None) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _id(backend: tokenizers.Tokenizer, token: str | None) -> int | None:
    return None if token is None else backend.token_to_id(token)


def declared_eos_ids(folder: Path) -> list[int]:
    """The EOS ids an HF folder declares: its ``generation_config.json``'s ``eos_token_id`` and its
    ``config.json``'s (each an id, a list or absent)."""
    return [
        i
        for name in ("generation_config.json", "config.json")
        for i in as_ids(_read_json(folder / name).get("eos_token_id"))
    ]


def as_ids(value: int | list[int] | None) -> list[int]:
    """A config's token id field (``eos_token_id``: one id, a list, or none) as a list."""
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _folder_chat_templates(
    folder: Path, config: dict[str, Any], specials: Mapping[str, str | None]
) -> tuple[ChatTemplate | None, dict[str, ChatTemplate]]:
    """The default template and the named others: ``chat_template.jinja`` and ``additional_chat_templates/NAME.jinja``,
    or tokenizer_config.json's ``chat_template`` (a source, or ``[{"name": ..., "template": ...}]`` whose
    ``default`` is the default)."""
    jinja_file = folder / "chat_template.jinja"
    config_file = str(folder / "tokenizer_config.json")
    source = config.get("chat_template")
    sources = {t["name"]: (t["template"], config_file) for t in source} if isinstance(source, list) else {}
    if isinstance(source, str):
        sources["default"] = (source, config_file)
    if jinja_file.is_file():
        sources["default"] = (jinja_file.read_text(encoding="utf-8"), str(jinja_file))
    for file in sorted((folder / "additional_chat_templates").glob("*.jinja")):
        sources[file.stem] = (file.read_text(encoding="utf-8"), str(file))
    templates = {name: ChatTemplate(text, origin, specials) for name, (text, origin) in sources.items() if text}
    return templates.pop("default", None), templates


def _configured_special_tokens(config: dict[str, Any], special_map: dict[str, Any]) -> set[str]:
    """The tokens tokenizer_config.json (or special_tokens_map.json) calls special beyond those of a role:
    ``additional_special_tokens``, ``extra_special_tokens`` and ``added_tokens_decoder`` entries marked special."""
    listed = [*special_map.get("additional_special_tokens", []), *config.get("additional_special_tokens", [])]
    extra = config.get("extra_special_tokens") or []
    listed += list(extra.values()) if isinstance(extra, dict) else list(extra)
    decoder = config.get("added_tokens_decoder") or {}
    listed += [entry for entry in decoder.values() if isinstance(entry, dict) and entry.get("special")]
    return {text for token in listed if isinstance(text := _token_text(token), str)}


def _mark_special(backend: tokenizers.Tokenizer, tokens: set[str]) -> None:
    """``tokens`` (those the vocabulary has) special as transformers takes them: skipped by
    ``skip_special_tokens``, their other flags kept."""
    added = {token.content: token for token in backend.get_added_tokens_decoder().values()}
    marked = []
    for text in sorted(tokens):
        token = added.get(text)
        if backend.token_to_id(text) is None or (token is not None and token.special):
            continue
        flags = {flag: getattr(token, flag) for flag in _TOKEN_FLAGS} if token is not None else {"normalized": False}
        marked.append(tokenizers.AddedToken(text, special=True, **flags))
    if marked:
        backend.add_special_tokens(marked)


_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized")
SPECIAL_TOKEN_ROLES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

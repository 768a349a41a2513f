"""What a multimodal prompt carries, and what a multimodal model provides.

A prompt marks each image with the model's placeholder token (Gemma 3's ``<start_of_image>``,
Qwen3-VL's ``<|image_pad|>`` inside its vision markers). Before the engine sees the prompt,
each image goes through the model's :class:`MultiModalProcessor` into a
:class:`MultiModalItem` (the tensors its encoder takes, how many embeddings it yields, a hash of
its content), and :func:`expand_prompt` replaces each placeholder by the model's tokens for it;
a :class:`PlaceholderRange` records where the item's embeddings go in the prompt.

The engine encodes an item once, when the first prefill chunk that reaches its range is
scheduled (:class:`xinfer.multimodal.encoder_cache.EncoderCache` keeps outputs by content
hash), and hands each step the slices its chunks cover
(:func:`xinfer.forward_context.multimodal`); the model writes them over the token embeddings
at those rows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from torch import Tensor


@dataclass(frozen=True, eq=False)
class MultiModalItem:
    """One image (or other modality's item), ready for its encoder."""

    modality: str  # "image"
    content_hash: int  # of the item's content (pixels, size, mode), not of the file's bytes
    data: Mapping[str, Tensor]  # what the model's encoder takes (e.g. "pixel_values" [C, H, W])
    num_embeddings: int  # the rows the encoder yields: the prompt tokens it fills
    extra: Mapping[str, Any] = field(default_factory=dict)  # processor facts the model needs (e.g. a patch grid)
    # the positions the item's tokens advance a sequence by, where not one each: the tokens after it
    # move back by the difference (M-RoPE gives an image max(rows, columns) positions)
    num_positions: int | None = None


@dataclass(frozen=True)
class PlaceholderRange:
    """``item``'s embeddings fill prompt positions ``offset`` to ``offset + item.num_embeddings``."""

    offset: int
    item: MultiModalItem

    @property
    def end(self) -> int:
        return self.offset + self.item.num_embeddings

    @property
    def position_shift(self) -> int:
        """How far back the item moves the positions of the tokens after it."""
        positions = self.item.num_positions
        return 0 if positions is None else self.item.num_embeddings - positions


@runtime_checkable
class MultiModalProcessor(Protocol):
    """A model's side of a multimodal prompt, run on the host before the engine."""

    placeholders: Mapping[str, int]
    """Each modality the model takes, with the token id that marks an item in a prompt."""

    merges: Mapping[tuple[int, int], int]
    """Pairs of tokens the tokenizer writes as one token where they meet, at an item's replacement and the
    prompt around it (Gemma 3's runs of newlines: ``"\\n"`` then ``"\\n\\n"`` is ``"\\n\\n\\n"``), as a
    processor that replaces placeholders in the text before tokenizing it writes them."""

    def process(self, modality: str, data: Any) -> MultiModalItem:
        """The item for ``data`` (a ``PIL.Image.Image`` for images); ``ValueError`` for data
        the model cannot take (a clear message: it reaches API clients)."""
        ...

    def replacement(self, item: MultiModalItem) -> tuple[list[int], int]:
        """The tokens that replace ``item``'s placeholder in the prompt, and the index in them
        where its ``num_embeddings`` embedding positions start."""
        ...


@runtime_checkable
class MultiModalModel(Protocol):
    """What a :class:`xinfer.model.CausalLM` that takes images (or other media) adds.

    ``attend_within_items``: the tokens of one item attend to each other both ways in the
    language model (Gemma 3); the engine then never ends a prefill chunk inside an item, and
    each query of an item sees its item's later keys (``AttentionMetadata.key_limits``)."""

    attend_within_items: ClassVar[bool]

    def multimodal_processor(self, tokenizer: Any) -> MultiModalProcessor:
        """The model's processor (``tokenizer``: the engine's, or None)."""
        ...

    def encode(self, modality: str, items: Sequence[MultiModalItem]) -> list[Tensor]:
        """Each item's embeddings [num_embeddings, D] (D the model's choice, usually the hidden
        size), computed through :mod:`xinfer.ops` (``ops.encoder_attention`` for attention over
        patches), under ``torch.inference_mode`` on the model's device."""
        ...


def content_hash(*parts: bytes | str | int) -> int:
    """A 64-bit hash of ``parts`` that is the same in every process (unlike ``hash``)."""
    digest = hashlib.blake2b(digest_size=8)
    for part in parts:
        digest.update(part if isinstance(part, bytes) else str(part).encode())
        digest.update(b"\0")
    return int.from_bytes(digest.digest(), "little", signed=True)


def expand_prompt(
    processor: MultiModalProcessor, token_ids: Sequence[int], items: Sequence[MultiModalItem]
) -> tuple[list[int], list[PlaceholderRange]]:
    """``token_ids`` with the ``i``-th placeholder of each modality replaced by the tokens of
    that modality's ``i``-th item (a token either side of a replacement merged with its neighbour
    where ``processor.merges`` says so); with the ranges the items' embeddings fill."""
    placeholder_modality = {token: modality for modality, token in processor.placeholders.items()}
    queues: dict[str, list[MultiModalItem]] = {}
    for item in items:
        queues.setdefault(item.modality, []).append(item)
    counts = {m: sum(1 for t in token_ids if placeholder_modality.get(t) == m) for m in processor.placeholders}
    for modality, given in queues.items():
        if counts.get(modality, 0) != len(given):
            raise ValueError(
                f"the prompt has {counts.get(modality, 0)} {modality} placeholder(s) "
                f"(token {processor.placeholders[modality]}) for {len(given)} {modality}(s)"
            )
    expanded: list[int] = []
    ranges: list[PlaceholderRange] = []
    replaced_end = -1  # where the last replacement's tokens end
    for token in token_ids:
        queue = queues.get(placeholder_modality.get(token, ""))
        if not queue:
            if len(expanded) == replaced_end and _mergeable(processor, expanded, ranges, token):
                expanded[-1] = processor.merges[expanded[-1], token]
            else:
                expanded.append(token)
            continue
        item = queue.pop(0)
        tokens, start = processor.replacement(item)
        if start > 0 and _mergeable(processor, expanded, ranges, tokens[0]):
            tokens = [processor.merges[expanded.pop(), tokens[0]], *tokens[1:]]
        ranges.append(PlaceholderRange(len(expanded) + start, item))
        expanded += tokens
        replaced_end = len(expanded)
    return expanded, ranges


def _mergeable(processor: MultiModalProcessor, expanded: list[int], ranges: list[PlaceholderRange], token: int) -> bool:
    """Whether ``expanded``'s last token, not an item's embedding position, merges with ``token``."""
    return (
        bool(expanded) and (not ranges or len(expanded) > ranges[-1].end) and (expanded[-1], token) in processor.merges
    )

"""Images (and later other media) in prompts: the plugin-facing interface, preprocessing helpers,
the encoder-output cache. How a model plugs in: docs/plugins.md, "Multimodal models"."""

from xinfer.multimodal.encoder_cache import EncoderCache
from xinfer.multimodal.inputs import (
    MultiModalItem,
    MultiModalModel,
    MultiModalProcessor,
    PlaceholderRange,
    content_hash,
    expand_prompt,
)
from xinfer.multimodal.step import MultiModalEmbeddings, MultiModalSlice

__all__ = [
    "EncoderCache",
    "MultiModalEmbeddings",
    "MultiModalItem",
    "MultiModalModel",
    "MultiModalProcessor",
    "MultiModalSlice",
    "PlaceholderRange",
    "content_hash",
    "expand_prompt",
]

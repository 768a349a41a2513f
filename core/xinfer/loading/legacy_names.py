"""Tensor names of older transformers releases that transformers renames in every checkpoint it loads (its conversion
mapping's "legacy" entries), read the same way: image-text checkpoints saved by transformers 5.10 to 5.23 hold the
text model under a doubled prefix, ``model.language_model.model.`` or ``language_model.model.model.``."""

from __future__ import annotations

import re

from xinfer.loading.stored import Weights

_DOUBLED_TEXT_MODEL = re.compile(r"^(?:model\.language_model|language_model\.model)\.model\.")


def current_names(weights: Weights) -> Weights:
    """``weights`` under the names transformers gives them today."""
    return ((_DOUBLED_TEXT_MODEL.sub("model.language_model.", name), tensor) for name, tensor in weights)

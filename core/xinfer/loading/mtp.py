"""Multi-token-prediction (MTP, "NextN") layers: checkpoints of GLM-4.5+, DeepSeek-V3 and MiniMax-M2
store them after the decoder's layers, as ``model.layers.{i}`` with ``i >= num_hidden_layers``; Qwen's
under ``mtp.``. They serve speculative decoding, which xinfer does not run: they are skipped at load, with
one log line."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

from torch import Tensor

from xinfer.loading.stored import StoredTensor, Weights

log = logging.getLogger(__name__)

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def without_mtp_layers(weights: Weights, num_layers: int) -> Iterator[tuple[str, Tensor | StoredTensor]]:
    """``weights`` but the tensors of layers ``num_layers`` and beyond, and those under ``mtp.``."""
    logged = False
    for name, tensor in weights:
        layer = _LAYER.match(name)
        if name.startswith("mtp.") or (layer and int(layer[1]) >= num_layers):
            if not logged:
                where = "mtp.*" if layer is None else f"model.layers.{num_layers} and on"
                log.info("skipping the checkpoint's MTP layers (%s): xinfer does not run them", where)
                logged = True
            continue
        yield name, tensor

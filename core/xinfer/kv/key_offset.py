"""A per-channel key offset: keys ``k - c`` are stored instead of ``k``, with ``c`` one
vector per (layer, KV head), measured once on calibration text (the keys' mean).

Every score of a query moves by the same ``q · c``, and softmax ignores a shift shared
by a row, so attention is unchanged and needs no correction (a logit softcap breaks
that invariance: layers with one keep no offset). What it buys: real keys carry a large
mean in a few channels, and a per-token absmax or RMS scale sized for that mean leaves
few levels for the part that tells keys apart; after rotation the mean would spread over
every coordinate.
"""

from __future__ import annotations

from torch import Tensor


def subtract_offset(k: Tensor, offset: Tensor) -> Tensor:
    """k [..., Hkv, D] - offset [Hkv, D], in k's dtype."""
    return k - offset.to(k.dtype)

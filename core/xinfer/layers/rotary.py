"""Rotary position embeddings: a precomputed cos || sin table per position.

Scaling variants follow the formulas of their papers / model cards; the kind is
``rope_type`` in the HF config's rope parameters.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import Tensor, nn

from xinfer import ops
from xinfer.forward_context import step_context


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The rope parameters of ``config`` (for ``layer_type`` where they differ per
    layer type), from ``rope_parameters`` or the older ``rope_theta``/``rope_scaling``."""
    params: dict[str, Any] = getattr(config, "rope_parameters", None) or {}
    own = params.get(layer_type) if layer_type is not None else None  # where they differ per layer type
    if own is not None:
        # transformers reads YaRN's truncate from the top of a per-layer-type dict, where it never is: truncated
        params = {**own, "truncate": params.get("truncate", True)}
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if params["rope_type"] in ("llama3", "longrope", "yarn"):  # the context it was trained at
        trained = getattr(config, "original_max_position_embeddings", None)
        if trained is not None and own is None:  # as transformers: a top-level value wins (Phi-3 writes it)
            params["original_max_position_embeddings"] = trained
        params.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    if params["rope_type"] in ("longrope", "yarn") and params.get("factor") is None:  # the ratio of the one it serves
        params["factor"] = config.max_position_embeddings / params["original_max_position_embeddings"]
    return params


def context_limit(config: Any) -> int:
    """The longest sequence the model's positions serve: its ``max_position_embeddings``, or where its rope is
    YaRN's, the context it was trained at times YaRN's factor if longer (as vLLM derives it: Qwen3's YaRN
    recipe scales a 32,768-token context 4 times, past its 40,960 positions)."""
    params = rope_parameters(config)
    if params["rope_type"] == "yarn" and params.get("factor") is not None:
        return max(config.max_position_embeddings, int(params["original_max_position_embeddings"] * params["factor"]))
    return config.max_position_embeddings


def _default(base: float, dim: int, params: dict) -> tuple[Tensor, float]:
    # fp32 like the reference implementations, so positions rotate identically
    return 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim), 1.0


def _linear(base: float, dim: int, params: dict) -> tuple[Tensor, float]:
    inv_freq, _ = _default(base, dim, params)
    return inv_freq / params["factor"], 1.0


def _llama3(base: float, dim: int, params: dict) -> tuple[Tensor, float]:
    inv_freq, _ = _default(base, dim, params)
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, blended)
    return torch.where(wavelen < old_context / high, inv_freq, scaled), 1.0


def _yarn(base: float, dim: int, params: dict) -> tuple[Tensor, float]:
    factor = params["factor"]
    old_context = params["original_max_position_embeddings"]
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):  # gpt-oss keeps the range's bounds fractional
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low or 1e-3)).clamp(0, 1)
    extrapolation, _ = _default(base, dim, params)
    inv_freq = extrapolation / factor * ramp + extrapolation * (1 - ramp)
    mscale = params.get("attention_factor")
    if mscale is None and params.get("mscale") and params.get("mscale_all_dim"):  # DeepSeek's: their ratio
        mscale = yarn_mscale(factor, params["mscale"]) / yarn_mscale(factor, params["mscale_all_dim"])
    elif mscale is None:
        mscale = yarn_mscale(factor)
    return inv_freq, mscale


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context ``factor`` times the original."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _proportional(base: float, dim: int, params: dict) -> tuple[Tensor, float]:
    """The first ``partial_rotary_factor`` of a whole head's frequencies, the rest 0 (those
    dims stay put): the table spans the head, unlike partial rotary's (Gemma 4's global layers)."""
    rotated = int(params.get("partial_rotary_factor", 1.0) * dim // 2)
    inv_freq = 1.0 / base ** (torch.arange(0, 2 * rotated, 2, dtype=torch.int64).float() / dim)
    return torch.cat((inv_freq, torch.zeros(dim // 2 - rotated))) / params.get("factor", 1.0), 1.0


def _dynamic(base: float, dim: int, params: dict) -> tuple[Tensor, float]:
    """Dynamic NTK scaling: it raises the base only for sequences longer than
    ``max_position_embeddings``, which ``max_model_len`` never exceeds: the default table."""
    if dim <= 2:  # transformers raises the base to dim / (dim - 2) even unscaled: a division by zero
        raise ValueError(f"rope_type 'dynamic' over {dim} rotated dims (head_dim * partial_rotary_factor) is not "
                         f"supported: its base scales by the power dim / (dim - 2)")  # fmt: skip
    return _default(base, dim, params)


def _longrope(base: float, dim: int, params: dict, factors: str = "short_factor") -> tuple[Tensor, float]:
    """LongRoPE (Phi-3.5, Phi-4): each frequency divided by its own factor, the short ones for
    sequences within the trained context (the long ones past it: :class:`RotaryEmbedding`),
    cos and sin scaled by ``sqrt(1 + ln(factor) / ln(trained context))``."""
    for key in ("short_factor", "long_factor"):
        if len(params[key]) != dim // 2:  # transformers divides the frequencies by them: a shape error
            raise ValueError(f"rope_parameters {key} has {len(params[key])} values, not the {dim // 2} of the "
                             f"{dim} rotated dims' pairs (head_dim * partial_rotary_factor / 2)")  # fmt: skip
    inv_freq, _ = _default(base, dim, params)
    factor, trained = params["factor"], params["original_max_position_embeddings"]
    scale = params.get("attention_factor")
    if scale is None:
        scale = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(trained))
    return inv_freq / torch.tensor(params[factors], dtype=torch.float32), scale


_INV_FREQ = {
    "default": _default,
    "linear": _linear,
    "llama3": _llama3,
    "yarn": _yarn,
    "proportional": _proportional,
    "longrope": _longrope,
    "dynamic": _dynamic,
}
_WHOLE_HEAD = {"proportional"}  # rope types whose table spans the head whatever partial_rotary_factor says


def pairs_to_halves(rows: Tensor, num_heads: int, rotary_dim: int | None = None) -> Tensor:
    """Per head, the rotated rows reordered from adjacent pairs ``[x0, y0, x1, y1, ..]`` to
    halves ``[x0, x1, .., y0, y1, ..]``: rotating the pairs (GPT-J style) is then rotating the
    halves (NeoX style, as ``ops.rotary`` does). The first ``rotary_dim`` rows of each head
    rotate (all of them by default); the rest keep their place."""
    head_dim = rows.shape[0] // num_heads
    rotary_dim = rotary_dim or head_dim
    arange = functools.partial(torch.arange, device=rows.device)
    order = torch.cat((arange(0, rotary_dim, 2), arange(1, rotary_dim, 2), arange(rotary_dim, head_dim)))
    return rows.unflatten(0, (num_heads, head_dim))[:, order].flatten(0, 1)


def inverse_frequencies(head_dim: int, params: dict[str, Any]) -> tuple[Tensor, float]:
    """The rope's inverse frequencies [rotary_dim / 2] (fp32) and the factor on its cos and sin
    (YaRN's temperature; 1 otherwise), from rope parameters as :func:`rope_parameters` gives them."""
    rope_type = params["rope_type"]
    if rope_type not in _INV_FREQ:
        raise NotImplementedError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(_INV_FREQ)}")
    partial = 1.0 if rope_type in _WHOLE_HEAD else params.get("partial_rotary_factor", 1.0)
    if not 0 <= partial <= 1:  # transformers builds the model, then its rotation fails on a shape
        raise ValueError(f"partial_rotary_factor {partial} is not supported: it rotates {int(head_dim * partial)} "
                         f"dims of a {head_dim}-dim head (the share rotated is in [0, 1])")  # fmt: skip
    base, factor = params["rope_theta"], params.get("factor")
    if not base > 0 or (rope_type == "yarn" and base == 1):  # NaN frequencies; YaRN divides by ln(base)
        raise ValueError(f"rope_theta {base} with rope_type {rope_type!r} is not supported: the rope's base is "
                         f"positive{' and not 1 (YaRN divides by its logarithm)' if rope_type == 'yarn' else ''}")  # fmt: skip
    if rope_type != "default" and factor is not None and not factor > 0:  # infinite or negative wavelengths
        raise ValueError(f"rope_parameters factor {factor} with rope_type {rope_type!r} is not supported: "
                         "the context's scaling factor is positive")  # fmt: skip
    return _INV_FREQ[rope_type](base, int(head_dim * partial), params)


def _cos_sin(inv_freq: Tensor, max_position: int, scale: float) -> Tensor:
    angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq.float())
    return torch.cat((angles.cos(), angles.sin()), dim=-1) * scale


class RotaryEmbedding(nn.Module):
    """The cos || sin table of every position. LongRoPE with long factors of its own keeps a second table below
    the first, for the tokens of the steps of sequences longer than the trained context (``trained_context``;
    where it is the model's ``context_switch``, the scheduler recomputes a sequence that grows past it, so that
    all its positions turn by the long factors, as in transformers' Phi-3 ``generate``)."""

    cos_sin: Tensor

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]):
        super().__init__()
        inv_freq, scale = inverse_frequencies(head_dim, params)
        self.rotary_dim = 2 * inv_freq.shape[0]
        self.max_position = max_position
        self.trained_context: int | None = None
        tables = [_cos_sin(inv_freq, max_position, scale)]
        if params["rope_type"] == "longrope" and params["long_factor"] != params["short_factor"]:
            self.trained_context = params["original_max_position_embeddings"]
            long_freq, _ = _longrope(params["rope_theta"], self.rotary_dim, params, "long_factor")
            tables.append(_cos_sin(long_freq, max_position, scale))
        self.register_buffer("cos_sin", torch.cat(tables), persistent=False)

    def forward(
        self, positions: Tensor, q: Tensor, k: Tensor, norms: ops.HeadNorms | None = None
    ) -> tuple[Tensor, Tensor]:
        rotation = self.rotation(positions, norms)
        return ops.rotary(q, k, rotation.positions, rotation.cos_sin, rotation.norms)

    def rotation(self, positions: Tensor, norms: ops.HeadNorms | None = None) -> ops.Rotation:
        """The rotation of the step's ``positions`` as the ops take it (:class:`xinfer.ops.Rotation`)."""
        if self.trained_context is not None:
            positions = positions + self.max_position * _longer_than(self.trained_context, positions)
        return ops.Rotation(positions, self.cos_sin, norms)


def _longer_than(context: int, positions: Tensor) -> Tensor:
    """Per token of the step: 1 where its sequence is longer than ``context`` tokens, else 0
    (computed by the step's first layer, reused by the others)."""
    derived = step_context().derived
    key = f"longer_than_{context}"
    if key not in derived:
        seqs = step_context().seqs
        token = torch.arange(positions.shape[-1], device=positions.device, dtype=seqs.cu_seqlens_q.dtype)
        seq = torch.searchsorted(seqs.cu_seqlens_q[1:], token, right=True).clamp_(max=seqs.num_seqs - 1)
        derived[key] = (seqs.seq_lens[seq] > context).to(positions.dtype)
    return derived[key]

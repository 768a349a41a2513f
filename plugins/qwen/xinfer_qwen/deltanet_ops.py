"""The ops of a Gated DeltaNet layer, in plain torch: the causal depthwise conv1d over each
sequence's stream and the gated delta rule (its gates computed from the projections), both
carrying a recurrent state per sequence in a slot of a state tensor, and the gated RMSNorm
of its output (the op the layer calls, :func:`gated_delta_rule_norm`, is the rule and the norm).

Shapes are flat over the step's tokens as :class:`xinfer.ops.AttentionMetadata` lays them
out: sequence ``b`` owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``, the last ``q_len``
tokens of its ``seq_lens[b]``. A sequence whose every token is in this step starts from a
zero state (its slot's old content is never read); every other one continues from its
slot, ``slots[b]``. Both ops write each sequence's final state back to its slot. These
references loop over the sequences in Python; the CUDA kernels are in
:mod:`xinfer_qwen.kernels`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from xinfer.activations import ACTIVATIONS, ALIASES, identity
from xinfer.ops import AttentionMetadata


def _activation(name: str | None) -> Callable[[Tensor], Tensor]:
    """The conv's activation by its HF name (None: none); one error where xinfer has no such activation."""
    if name is None:
        return identity
    if ALIASES.get(name, name) not in ACTIVATIONS:
        known = ", ".join([*ACTIVATIONS, *ALIASES])
        raise ValueError(f"causal_conv1d: unknown activation {name!r}; known: None, {known}")
    return ACTIVATIONS[ALIASES.get(name, name)]


def _sequences(meta: AttentionMetadata, slots: Tensor):
    """(rows, slot, starts) of each sequence with rows in this step."""
    bounds, seq_lens = meta.cu_seqlens_q.tolist(), meta.seq_lens.tolist()
    for b, slot in enumerate(slots.tolist()):
        lo, hi = bounds[b], bounds[b + 1]
        if hi > lo:
            yield slice(lo, hi), slot, seq_lens[b] == hi - lo


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    state: Tensor,
    meta: AttentionMetadata,
    slots: Tensor,
    activation: str | None = "silu",
) -> Tensor:
    """Depthwise causal convolution of ``x`` [T, C] with ``weight`` [C, K] over each
    sequence's input stream ``u``, whose K-1 values before this step are ``state[slot]``
    [C, K-1] (zeros when the sequence starts)::

        out[t, c] = act(bias[c] + sum_i weight[c, i] * u[t - (K-1) + i, c])

    ``act`` is any activation of :data:`xinfer.activations.ACTIVATIONS` by its HF name, or none.
    Afterwards ``state[slot]`` holds the last K-1 values of ``u``. Computed in fp32;
    returns [T, C] in the dtype of ``x``."""
    act = _activation(activation)
    channels, width = weight.shape
    out = torch.zeros_like(x)
    for rows, slot, starts in _sequences(meta, slots):
        history = torch.zeros_like(state[slot]) if starts else state[slot]
        stream = torch.cat([history.float(), x[rows].T.float()], dim=1)  # [C, K-1 + q_len]
        y = F.conv1d(stream[None], weight.float()[:, None], None if bias is None else bias.float(), groups=channels)
        out[rows] = act(y[0].T).to(x.dtype)
        state[slot] = stream[:, stream.shape[1] - (width - 1) :].to(state.dtype)
    return out


def l2_normalize(x: Tensor) -> Tensor:
    """``x`` over its last dim divided by its L2 norm (as flash-linear-attention's, with 1e-6 under the root)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def gates(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """The log decays ``g = -exp(A_log) * softplus(a + dt_bias)`` (<= 0) and the write strengths
    ``beta = sigmoid(b)`` [T, Hv], both in fp32, from ``a``, ``b`` [T, Hv] and ``A_log``,
    ``dt_bias`` [Hv]."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.float().sigmoid()


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    state: Tensor,
    meta: AttentionMetadata,
    slots: Tensor,
) -> Tensor:
    """:func:`delta_rule` with the decays and write strengths of :func:`gates` (one op, so
    that a decode kernel computes them where it reads them)."""
    return delta_rule(q, k, v, *gates(a, b, A_log, dt_bias), state, meta, slots)


def gated_delta_rule_norm(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor,
                          state: Tensor, meta: AttentionMetadata, slots: Tensor, z: Tensor, norm_weight: Tensor,
                          eps: float) -> Tensor:  # fmt: skip
    """:func:`gated_rms_norm` (``z`` [T, Hv, Dv], ``norm_weight``, ``eps``) of :func:`gated_delta_rule`'s
    output, [T, Hv * Dv]: one op, so that a decode kernel normalizes each head where it finishes it."""
    return gated_rms_norm(gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, meta, slots), z, norm_weight, eps)


def delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
    meta: AttentionMetadata,
    slots: Tensor,
) -> Tensor:
    """The gated delta rule over ``q``, ``k`` [T, Hk, Dk], ``v`` [T, Hv, Dv], the log decays
    ``g`` [T, Hv] (<= 0) and the write strengths ``beta`` [T, Hv] (in (0, 1)); value head
    ``h`` reads key head ``h // (Hv // Hk)``. ``q`` and ``k`` are L2-normalized, ``q`` then
    scaled by Dk^-0.5. Per sequence and value head, with ``S = state[slot, h]`` [Dk, Dv]::

        S <- exp(g_t) * S
        S <- S + k_t (beta_t * (v_t - S^T k_t))^T
        o_t = S^T q_t

    In fp32; returns [T, Hv, Dv] in the dtype of ``v``, the state kept in its own dtype."""
    group, dtype = v.shape[1] // k.shape[1], v.dtype
    q = l2_normalize(q.float()).repeat_interleave(group, dim=1) * q.shape[-1] ** -0.5
    k = l2_normalize(k.float()).repeat_interleave(group, dim=1)
    v, g, beta = v.float(), g.float(), beta.float()
    out = torch.zeros_like(v)
    for rows, slot, starts in _sequences(meta, slots):
        s = torch.zeros_like(state[slot], dtype=torch.float32) if starts else state[slot].float()  # [Hv, Dk, Dv]
        for t in range(rows.start, rows.stop):
            s = g[t].exp()[:, None, None] * s
            delta = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", s, k[t]))
            s = s + k[t][:, :, None] * delta[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", s, q[t])
        state[slot] = s.to(state.dtype)
    return out.to(dtype)


def gated_rms_norm(x: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``rms_norm(x) * silu(z)`` over the last dim of ``x`` [T, H, D] (each head's values),
    ``z`` [T, H, D]: in fp32, the norm rounded to the dtype of ``x`` before its ``weight``
    and the gate (as transformers' ``RMSNormGated``). Returns [T, H * D] in the dtype of ``x``."""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight.float() * normed.float() * F.silu(z.float())).to(x.dtype).flatten(1)

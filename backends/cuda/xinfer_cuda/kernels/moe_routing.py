"""A router's math in one launch (see :meth:`xinfer.ops.Ops.moe_route`): a program per
token holds its E scores in registers and picks its experts there, where the torch
reference takes some ten launches (scores, correction, group top-2s, top-k, gather,
renormalization, scaling) of a few microseconds each: at batch 1 these, not bytes, are
the cost.

Ties break to the lower expert, as argmax does; the top k are the experts ranked below k.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from torch import Tensor

from xinfer_cuda.kernels import launch
from xinfer_cuda.kernels.launch import pdl_entry

if TYPE_CHECKING:
    from xinfer.layers.moe import Routing

SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")


@triton.jit
def _argmax(values, index):
    """The first index of the largest value, and that value."""
    best = tl.max(values, axis=0)
    return tl.min(tl.where(values == best, index, values.shape[0]), axis=0), best


@triton.jit
def route_row(
    logits, experts, bias_ptr, weights_ptr, ids_ptr, num_experts, group_size, scaling_factor, shared_weight,
    SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr, NUM_GROUPS: tl.constexpr,
    TOPK_GROUPS: tl.constexpr, TOP_K: tl.constexpr, SHARED: tl.constexpr,
):  # fmt: skip
    """One token's routing from its logits [BLOCK_E] (fp32, -inf past ``num_experts``):
    its weights and ids stored at ``weights_ptr`` and ``ids_ptr`` [TOP_K + SHARED], the
    ``SHARED`` experts after the routed ones (``num_experts`` on) weighted ``shared_weight``."""
    valid = experts < num_experts
    if SCORING == "softmax":
        exp = tl.exp(logits - tl.max(logits, axis=0))
        scores = exp / tl.sum(exp, axis=0)
    elif SCORING == "sigmoid":
        scores = tl.sigmoid(logits)
    else:  # sqrtsoftplus; softplus(x) = max(x, 0) + log(1 + exp(-|x|))
        scores = tl.sqrt(tl.maximum(logits, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(logits))))
    choice = scores
    if HAS_BIAS:
        choice += tl.load(bias_ptr + experts, mask=valid, other=0.0)
    # NaN scores (a padded row of a captured step reads whatever its buffer holds) rank last, so
    # that every id names an expert: fused_moe reads the weights of the ids it is handed
    choice = tl.where(valid & (choice == choice), choice, -float("inf"))
    if NUM_GROUPS > 1:  # keep the TOPK_GROUPS groups whose two best experts score most
        group = experts // group_size
        group_scores = tl.full((NUM_GROUPS,), -float("inf"), tl.float32)
        for g in tl.static_range(NUM_GROUPS):
            in_group = tl.where(group == g, choice, -float("inf"))
            first, best = _argmax(in_group, experts)
            second = tl.max(tl.where(experts == first, -float("inf"), in_group), axis=0)
            group_scores = tl.where(tl.arange(0, NUM_GROUPS) == g, best + second, group_scores)
        kept = tl.zeros(experts.shape, tl.int1)
        for _ in tl.static_range(TOPK_GROUPS):
            best_group, _score = _argmax(group_scores, tl.arange(0, NUM_GROUPS))
            kept |= group == best_group
            group_scores = tl.where(tl.arange(0, NUM_GROUPS) == best_group, -float("inf"), group_scores)
        choice = tl.where(kept, choice, -float("inf"))
    # Each expert's rank among the choices (those above it, and those equal to it of a lower
    # index, argmax's order), compared with a chunk of the others at a time: the experts of
    # rank below TOP_K are the choice, stored at their rank (best first). One pass, where
    # TOP_K rounds of argmax took three reductions across the program each (at 128 experts,
    # top-8, most of a batch-1 routing's time).
    BLOCK_E: tl.constexpr = experts.shape[0]
    CHUNK: tl.constexpr = BLOCK_E if BLOCK_E <= 64 else 4096 // BLOCK_E  # (qwen3: 128 x 32 pairs, four chunks)
    rank = tl.zeros((BLOCK_E,), tl.int32)
    for first in tl.static_range(0, BLOCK_E, CHUNK):
        others = first + tl.arange(0, CHUNK)
        other_choice = tl.gather(choice, others, 0)[None, :]
        above = (other_choice > choice[:, None]) | (
            (other_choice == choice[:, None]) & (others[None, :] < experts[:, None])
        )
        rank += tl.sum(above.to(tl.int32), axis=1)
    chosen = rank < TOP_K  # (experts past num_experts rank after every real one)
    weights = tl.where(chosen, scores, 0.0)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    weights *= scaling_factor
    tl.store(ids_ptr + rank, experts, mask=chosen)
    tl.store(weights_ptr + rank, weights, mask=chosen)
    for j in tl.static_range(SHARED):
        tl.store(ids_ptr + TOP_K + j, num_experts + j)
        tl.store(weights_ptr + TOP_K + j, shared_weight)


@triton.jit
def shared_weight_of(logits_ptr, num_experts, SHARED_GATE: tl.constexpr):
    """The shared experts' weight of a token whose logits are at ``logits_ptr``: the sigmoid of
    the logit after its experts' where gated, else 1."""
    if SHARED_GATE:
        return tl.sigmoid(tl.load(logits_ptr + num_experts).to(tl.float32))
    return 1.0


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr,
    num_experts, group_size, stride_logits, scaling_factor,
    SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr, NUM_GROUPS: tl.constexpr,
    TOPK_GROUPS: tl.constexpr, TOP_K: tl.constexpr, SHARED: tl.constexpr, SHARED_GATE: tl.constexpr,
    BLOCK_E: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_entry(PDL)
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    row = logits_ptr + token * stride_logits
    logits = tl.load(row + experts, mask=experts < num_experts, other=-float("inf")).to(tl.float32)
    width = TOP_K + SHARED
    route_row(logits, experts, bias_ptr, weights_ptr + token * width, ids_ptr + token * width, num_experts,
              group_size, scaling_factor, shared_weight_of(row, num_experts, SHARED_GATE), SCORING, HAS_BIAS,
              RENORMALIZE, NUM_GROUPS, TOPK_GROUPS, TOP_K, SHARED)  # fmt: skip


def covers(routing: Routing) -> bool:
    """Whether :func:`moe_route` computes ``routing``: every scoring, groups in a power of
    two (a fixed table and a per-expert scale never reach it)."""
    return routing.scoring in SCORINGS and routing.num_groups & (routing.num_groups - 1) == 0


def moe_route(logits: Tensor, routing: Routing, correction_bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """:meth:`xinfer.ops.Ops.moe_route` in one launch: weights [T, k + n] fp32, ids [T, k + n] int32
    (n: the shared experts)."""
    num_tokens, num_experts = logits.shape[0], logits.shape[1] - routing.shared_gate
    weights, ids = routed(num_tokens, routing, logits.device)
    if num_tokens == 0:
        return weights, ids
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    bias = correction_bias if correction_bias is not None else weights  # (unread)
    _route_kernel[(num_tokens,)](
        logits, bias, weights, ids, num_experts, num_experts // routing.num_groups, logits.stride(0),
        routing.scaling_factor, **route_constexprs(routing, num_experts, correction_bias is not None),
        num_warps=4 if num_experts <= 256 else 8, **launch.pdl(logits.device),
    )  # fmt: skip
    return weights, ids


def routed(num_tokens: int, routing: Routing, device: torch.device) -> tuple[Tensor, Tensor]:
    """The routing's outputs for ``num_tokens`` tokens, to fill: weights (fp32) and ids (int32), each
    [T, k + n] (n: the shared experts)."""
    width = routing.top_k + routing.shared_experts
    weights = torch.empty(num_tokens, width, dtype=torch.float32, device=device)
    return weights, torch.empty(num_tokens, width, dtype=torch.int32, device=device)


def route_constexprs(routing: Routing, num_experts: int, has_bias: bool) -> dict:
    """The constexprs of :func:`route_row` and :func:`shared_weight_of` (and ``BLOCK_E``) for
    ``routing`` over ``num_experts`` routed experts."""
    return dict(
        SCORING=routing.scoring, HAS_BIAS=has_bias, RENORMALIZE=routing.renormalize, NUM_GROUPS=routing.num_groups,
        TOPK_GROUPS=routing.topk_groups, TOP_K=routing.top_k, SHARED=routing.shared_experts,
        SHARED_GATE=routing.shared_gate, BLOCK_E=triton.next_power_of_2(num_experts),
    )  # fmt: skip

"""Every op in plain torch, on any torch device (see :class:`xinfer.ops.Ops` for the contract)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from xinfer import torch_sampling
from xinfer.activations import ACTIVATIONS
from xinfer.kv import LayerKVCache
from xinfer.ops import AttentionMetadata, HeadNorms, KernelHelpers, Rotation, act_and_mul_of
from xinfer.sampling import SamplingBatch

if TYPE_CHECKING:
    from xinfer.layers.moe import Routing

SCORING: dict[str, Callable[[Tensor], Tensor]] = {"softmax": lambda logits: logits.softmax(dim=-1), **ACTIVATIONS}
"""Router logits to expert scores, by the HF config's ``scoring_func``: a softmax over the experts, or any plain
activation applied to each (as DeepSeek V4's router takes any of transformers' ``ACT2FN``)."""


class TorchOps:
    """The reference of every op, and the base a backend subclasses to override op by op.

    What a backend supports is declared in class attributes, which
    :func:`xinfer.backend.check_support` checks once at start-up:

    - ``name``: the backend's name as in its :class:`~xinfer.hooks.BackendSpec` (kernels of
      plugin ops are registered under it, see :func:`xinfer.ops.get`);
    - ``kv_formats``: the KV cache formats its attention stores and reads, None for every
      one (the reference quantizes and decodes through the format itself);
    - ``recent_window``: its attention keeps the recent window of a quantized cache exact
      in shadow blocks (:class:`xinfer.ops.KeepsRecentWindow`);
    - ``weight_kernels``: the quantized weight formats it runs natively, each naming its
      :class:`xinfer.quant.WeightKernels` ("module:attribute"); every other format runs
      through the reference, which dequantizes per call (:mod:`xinfer.quant.dispatch`);
    - ``expert_activations``: the ``act`` its :meth:`fused_moe` computes (HF names, as
      :data:`xinfer.activations.ACTIVATIONS`), None for every one (the reference: torch's where no op
      fuses ``act``); start-up refuses a model whose experts take another.

    A subclass that overrides :meth:`attention` declares what its kernel does, and one whose
    device wants them overrides the :class:`~xinfer.ops.DeviceHooks` (here: host buffers not
    pinned; no Triton kernel runs on the reference, so it has no launch chain and lends no
    helpers).
    """

    name: str = "torch"
    kv_formats: frozenset[str] | None = None
    recent_window: bool = True
    weight_kernels: Mapping[str, str] = {}
    expert_activations: frozenset[str] | None = None

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        return torch.empty(shape, dtype=dtype)

    def launch_chain(self, device: torch.device) -> dict[str, Any]:
        raise NotImplementedError(f"the {self.name} backend runs no Triton kernels")

    def kernel_helpers(self) -> KernelHelpers:
        raise NotImplementedError(f"the {self.name} backend runs no Triton kernels")

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        return F.linear(x, weight, bias)

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None):
        if residual is not None:
            x = x + residual
            residual = x
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        out = (normed * weight.float()).to(x.dtype)
        return out if residual is None else (out, residual)

    def norm_linear(
        self,
        x: Tensor,
        residual: Tensor | None,
        norm_weight: Tensor,
        eps: float,
        weight: Tensor,
        bias: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        if residual is None:
            normed, h = self.rms_norm(x, norm_weight, eps), x
        else:
            normed, h = self.rms_norm(x, norm_weight, eps, residual)
        return self.linear(normed.to(weight.dtype), weight, bias), normed, h

    def norm_route(
        self,
        x: Tensor,
        residual: Tensor | None,
        norm_weight: Tensor,
        eps: float,
        weight: Tensor,
        routing: Routing,
        correction_bias: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        logits, normed, h = self.norm_linear(x, residual, norm_weight, eps, weight)
        weights, ids = self.moe_route(logits, routing, correction_bias)
        return weights, ids, normed, h

    def layer_norm(self, x: Tensor, weight: Tensor, bias: Tensor, eps: float, residual: Tensor | None = None):
        if residual is not None:
            x = x + residual
            residual = x
        out = F.layer_norm(x.float(), x.shape[-1:], weight.float(), bias.float(), eps).to(x.dtype)
        return out if residual is None else (out, residual)

    def rotary(self, q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor, norms: HeadNorms | None = None):
        if norms is not None:
            q, k = self.rms_norm(q, norms.q_weight, norms.eps), self.rms_norm(k, norms.k_weight, norms.eps)
        cos, sin = cos_sin[positions].chunk(2, dim=-1)  # [T, R/2] each
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def silu_and_mul(self, x: Tensor) -> Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_and_mul(self, x: Tensor) -> Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def gelu_and_mul(self, x: Tensor) -> Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate) * up

    def sigmoid_gate(self, y: Tensor, gate: Tensor) -> Tensor:
        return (torch.sigmoid(gate.float()) * y.float()).to(y.dtype)

    def add_gated(self, base: Tensor, y: Tensor, x: Tensor, gate_weight: Tensor) -> Tensor:
        gate = torch.sigmoid(x.float() @ gate_weight.float().T)
        return (base.float() + gate * y.float()).to(base.dtype)

    def fused_moe(
        self,
        x: Tensor,
        w13: Tensor,
        w2: Tensor,
        topk_weights: Tensor,
        topk_ids: Tensor,
        activation: str,
        limit: float | None = None,
        shared_experts: int = 0,  # (every slot alike here)
    ) -> Tensor:
        gated = act_and_mul_of(self, activation)

        def act_and_mul(gate_up: Tensor) -> Tensor:
            return gated(gate_up if limit is None else clamp_gate_up(gate_up, limit))

        top_k = topk_ids.shape[1]
        ids, weights = topk_ids.flatten(), topk_weights.flatten().float()
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for expert in ids.unique().tolist():
            slots = (ids == expert).nonzero().squeeze(1)  # (token, j) pairs routed to the expert
            tokens = slots // top_k
            y = F.linear(act_and_mul(F.linear(x[tokens], w13[expert])), w2[expert])
            out.index_add_(0, tokens, y.float() * weights[slots, None])
        return out.to(x.dtype)

    def moe_route(self, logits: Tensor, routing: Routing, correction_bias: Tensor | None) -> tuple[Tensor, Tensor]:
        scores = SCORING[routing.scoring](logits[:, : logits.shape[1] - routing.shared_gate].float())
        ids = top_experts(scores, routing, correction_bias)
        return with_shared_experts(expert_weights(scores, ids, routing), ids, logits, routing)

    def write_kv(self, k: Tensor, v: Tensor, cache: LayerKVCache, slot_mapping: Tensor) -> None:
        """The storing half of :meth:`attention` (benchmarks and tests fill caches with it)."""
        valid = slot_mapping >= 0
        slots = slot_mapping[valid]
        stored = cache.format.quantize(k[valid], v[valid], cache.dtype, cache.equalizer, cache.key_offset)
        for name, values in stored.items():
            tensor = cache[name]
            tensor.view(-1, *tensor.shape[2:])[slots] = values

    def write_shadow_kv(self, k: Tensor, v: Tensor, cache: LayerKVCache, shadow_slots: Tensor) -> None:
        assert cache.shadows is not None, "a recent window's writes need the cache's shadow blocks"
        valid = shadow_slots >= 0
        keys, values = cache.format.stored_basis(k[valid], v[valid], cache.equalizer, cache.key_offset)
        for shadow, x in zip(cache.shadows, (keys, values)):
            shadow.view(-1, *shadow.shape[2:])[shadow_slots[valid]] = x.to(shadow.dtype)

    def attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> Tensor:
        self.write_kv(k, v, cache, meta.slot_mapping)
        if meta.shadows is not None:
            self.write_shadow_kv(k, v, cache, meta.shadows.slot_mapping)
        return self.attend(q, cache, meta, scale, window, softcap)

    def rotary_attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        rotation: Rotation,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> Tensor:
        q, k = self.rotary(q, k, rotation.positions, rotation.cos_sin, rotation.norms)
        return self.attention(q, k, v, cache, meta, scale, window, softcap)

    def attend(
        self,
        q: Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> Tensor:
        """The attending half of :meth:`attention`, over the cache as it is (the
        reference the CUDA kernels are tested against)."""
        dtype = q.dtype
        q = cache.format.prepare_query(q, cache.equalizer)
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        cu = meta.cu_seqlens_q.tolist()
        seq_lens = meta.seq_lens.tolist()
        for b, context_len in enumerate(seq_lens):
            start, end = cu[b], cu[b + 1]
            if end == start:
                continue
            # a sliding window hides every key before the first query's window
            first = 0 if window is None else max(0, context_len - (end - start) - window + 1)
            stored = {n: gather_context(t, meta.block_tables[b], context_len, first) for n, t in cache.tensors.items()}
            k, v = cache.format.decode(stored)  # one sequence's visible context, in fp32
            exact = shadow_context(cache, meta.shadows.tables[b], context_len, first) if meta.shadows else None
            limits = meta.key_limits[start:end] if meta.key_limits is not None else None
            out[start:end] = attend(q[start:end], k, v, scale, window, softcap, exact, first, limits)
        return cache.format.finish_output(out).to(dtype)

    def encoder_attention(self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, scale: float) -> Tensor:
        out = torch.empty_like(q)
        group = q.shape[1] // k.shape[1]
        bounds = cu_seqlens.tolist()
        for start, end in itertools.pairwise(bounds):
            qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))  # [heads, L, D]
            if group > 1:
                ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
            out[start:end] = F.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(0, 1)
        return out

    def sample(self, logits: Tensor, params: SamplingBatch) -> Tensor:
        return torch_sampling.sample(logits, params)

    def apply_token_bitmask(self, logits: Tensor, bitmask: Tensor, rows: Tensor) -> None:
        vocab = logits.shape[1]
        bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        allowed = ((bitmask[:, :, None] >> bits) & 1).flatten(1)[:, :vocab].bool()
        if allowed.shape[1] < vocab:  # tokens past the bitmask: not allowed
            allowed = F.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


@dataclass
class ExactKeys:
    """A context's exact K/V from shadow blocks, and the rule for when a query reads them."""

    k: Tensor  # [L, Hkv, D]
    v: Tensor
    has_shadow: Tensor  # [L] bool
    recent_window: int
    first_block: int  # positions read exact by every query (the sinks)

    def read_by(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """[Q, L] whether query ``q_pos`` reads key ``k_pos`` exact."""
        near = (q_pos - k_pos < self.recent_window) | (k_pos < self.first_block)
        return self.has_shadow & near


def shadow_context(cache: LayerKVCache, shadow_table: Tensor, context_len: int, first: int = 0) -> ExactKeys:
    """The exact K/V of positions ``first`` to ``context_len``."""
    assert cache.shadows is not None, "a recent window's reads need the cache's shadow blocks"
    block_size = cache.block_size
    table = shadow_table[: -(-context_len // block_size)]
    k, v = (gather_context(s, table.clamp(min=0), context_len, first).float() for s in cache.shadows)
    has_shadow = (table >= 0).repeat_interleave(block_size)[first:context_len]
    return ExactKeys(k, v, has_shadow, cache.recent_window, block_size)


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    exact: ExactKeys | None = None,
    first: int = 0,
    key_limits: Tensor | None = None,
) -> Tensor:
    """Causal attention of the last ``len(q)`` positions over keys at positions
    ``first`` to ``first + len(k)``, in fp32; with ``exact``, each (query, key) pair its
    rule picks uses the exact K/V instead; with ``key_limits`` [Q], query ``i`` sees keys
    up to position ``key_limits[i]`` instead of its own.

    q [Q, H, D], k and v [L, Hkv, D] with H a multiple of Hkv.
    """
    num_q, num_heads, head_dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    context_len = first + num_keys
    dtype = q.dtype
    group = num_heads // num_kv_heads
    # heads grouped by the KV head they share: [Hkv, group * Q, D]
    q = q.float().view(num_q, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).flatten(1, 2)

    def scores_of(keys: Tensor) -> Tensor:
        scores = q @ keys.float().transpose(0, 1).transpose(1, 2) * scale
        return softcap * torch.tanh(scores / softcap) if softcap is not None else scores

    scores = scores_of(k)
    q_pos = torch.arange(context_len - num_q, context_len, device=q.device).repeat(group).unsqueeze(1)
    k_pos = torch.arange(first, context_len, device=q.device).unsqueeze(0)
    if exact is not None:
        from_exact = exact.read_by(q_pos, k_pos)  # [group * Q, L], the same for every KV head
        scores = torch.where(from_exact, scores_of(exact.k), scores)
    limits = q_pos if key_limits is None else key_limits.to(q_pos).repeat(group).unsqueeze(1)
    visible = k_pos <= limits
    if window is not None:
        visible &= k_pos > q_pos - window
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    out = probs @ v.float().transpose(0, 1)
    if exact is not None:
        out += (probs * from_exact) @ (exact.v.transpose(0, 1) - v.float().transpose(0, 1))
    out = out.view(num_kv_heads, group, num_q, head_dim).permute(2, 0, 1, 3)
    return out.reshape(num_q, num_heads, head_dim).to(dtype)


def gather_context(cache: Tensor, block_table: Tensor, context_len: int, first: int = 0) -> Tensor:
    """Positions ``first`` to ``context_len`` of one sequence's blocks of ``cache``."""
    block_size = cache.shape[1]
    first_block, last_block = first // block_size, -(-context_len // block_size)
    blocks = cache[block_table[first_block:last_block].long()]  # [n, block_size, Hkv, D]
    offset = first_block * block_size
    return blocks.flatten(0, 1)[first - offset : context_len - offset]


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    rot_dim = cos.shape[-1] * 2
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    x1, x2 = x_rot.float().chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1).float(), sin.unsqueeze(1).float()
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    return torch.cat((rotated, x_pass), dim=-1) if x_pass.numel() else rotated


def clamp_gate_up(gate_up: Tensor, limit: float) -> Tensor:
    """A clamped SwiGLU's inputs: the gate half [..., :n] at most ``limit``, the up half within ``limit``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.cat((gate.clamp(max=limit), up.clamp(-limit, limit)), dim=-1)


def top_experts(scores: Tensor, routing: Routing, correction_bias: Tensor | None) -> Tensor:
    """The ``top_k`` experts of each token by its (corrected, group-limited) scores [T, E]."""
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if routing.num_groups > 1:
        groups = choice.unflatten(-1, (routing.num_groups, -1))  # [T, G, E/G]
        group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)
        best = group_scores.topk(routing.topk_groups, dim=-1).indices
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = groups.masked_fill(~kept.unsqueeze(-1), float("-inf")).flatten(1)
    return choice.topk(routing.top_k, dim=-1).indices


def with_shared_experts(weights: Tensor, ids: Tensor, logits: Tensor, routing: Routing) -> tuple[Tensor, Tensor]:
    """The routed ``weights`` and ``ids`` [T, k] followed by the ``routing.shared_experts`` experts every
    token takes (those after the routed ones of ``logits`` [T, E (+ 1)]), weighted 1, or, with
    ``routing.shared_gate``, the sigmoid of each token's last logit."""
    if not routing.shared_experts:
        return weights, ids
    tokens, first = ids.shape[0], logits.shape[1] - routing.shared_gate
    shared_ids = torch.arange(first, first + routing.shared_experts, dtype=ids.dtype, device=ids.device)
    gate = logits[:, -1:].float().sigmoid() if routing.shared_gate else weights.new_ones(tokens, 1)
    shared_weights = gate.expand(tokens, routing.shared_experts)
    return torch.cat((weights, shared_weights), dim=1), torch.cat((ids, shared_ids.expand(tokens, -1)), dim=1)


def expert_weights(scores: Tensor, ids: Tensor, routing: Routing) -> Tensor:
    """The weights [T, k] of experts ``ids`` from the scores [T, E]: renormalized, scaled."""
    weights = scores.gather(1, ids)
    if routing.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routing.scaling_factor != 1.0:
        weights = weights * routing.scaling_factor
    return weights

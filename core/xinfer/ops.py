"""The kernel interface every backend implements, and the one in use.

Models call the functions of this module; :func:`use` points them at a backend.
Shapes are flat over the tokens of a step (no batch dimension):
``T`` tokens, ``H`` query heads, ``Hkv`` KV heads, ``D`` head dim.

Besides the ops of :class:`Ops`, plugins register ops of their own
(:class:`xinfer.hooks.OpSpec`), which models call with :func:`call`.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from xinfer import registry
from xinfer.activations import ACTIVATIONS, act_and_mul
from xinfer.hooks import OpSpec
from xinfer.kv import LayerKVCache
from xinfer.quant import dispatch as quantized
from xinfer.quant.tensor import QuantizedTensor
from xinfer.sampling import SampledRow, SamplingBatch


@dataclass(frozen=True)
class ShadowPages:
    """A recent window's shadow blocks (:class:`xinfer.cache.recent_window.RecentWindow`):
    each block's exact copy in the cache's ``shadows`` (-1: none), and each token's slot
    there (-1: not written)."""

    tables: Tensor  # [B, max_blocks] int32
    slot_mapping: Tensor  # [T] int64


if TYPE_CHECKING:
    from xinfer.layers.moe import Routing


@dataclass
class AttentionMetadata:
    """Where each sequence's queries sit in the flat batch, and where its KV lives.

    Sequence ``b`` owns query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``; these are the
    last ``q_len`` positions of a context of ``seq_lens[b]`` tokens, whose KV is in
    the cache blocks ``block_tables[b]`` (this step's KV included: it is written
    before attention runs). Token ``i`` of the step goes to cache slot
    ``slot_mapping[i] = block * block_size + offset``; a negative slot is skipped
    (padding).
    """

    cu_seqlens_q: Tensor  # [B + 1] int32
    seq_lens: Tensor  # [B] int32
    block_tables: Tensor  # [B, max_blocks] int32
    slot_mapping: Tensor  # [T] int64
    max_seqlen_q: int  # 1 when no sequence has more than one query; else may be an upper bound
    max_seq_len: int
    shadows: ShadowPages | None = None  # with a recent window
    # [T] int32, or None: query row i sees keys up to position key_limits[i] (>= its own
    # position) instead of its own position; set where tokens of one image attend to each
    # other both ways (MultiModalModel.attend_within_items)
    key_limits: Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


def without_kv(cu_seqlens_q: Tensor, seq_lens: Tensor, max_seqlen_q: int, max_seq_len: int) -> AttentionMetadata:
    """A step's metadata where the model caches no KV (every layer recurrent): where the queries sit and
    how long each context is, no blocks (``block_tables`` [B, 0], ``slot_mapping`` [0])."""
    no_blocks = seq_lens.new_zeros((seq_lens.shape[0], 0))
    return AttentionMetadata(cu_seqlens_q, seq_lens, no_blocks, no_blocks.new_zeros(0, dtype=torch.int64),
                             max_seqlen_q, max_seq_len)  # fmt: skip


@dataclass(frozen=True)
class HeadNorms:
    """RMSNorm of every query and key head over its head dim, applied before rotation
    (the q/k norms of Qwen3 and Gemma3): ``x * rsqrt(mean(x^2) + eps) * weight``."""

    q_weight: Tensor  # [D]
    k_weight: Tensor  # [D]
    eps: float


@dataclass(frozen=True)
class Rotation:
    """What :meth:`Ops.rotary` takes besides q and k: the positions [T], the cos || sin table
    [max_pos, R] they index, and the heads' norms if any."""

    positions: Tensor
    cos_sin: Tensor
    norms: HeadNorms | None = None


@dataclass(frozen=True)
class KernelHelpers:
    """The ``@triton.jit`` functions a backend that runs Triton kernels lends plugins' kernels,
    which take them as constexpr arguments (see :mod:`xinfer.kernel_api`)."""

    # (cu_seqlens_q_ptr, num_seqs, tile, Q_PER_TILE: constexpr) -> the sequence whose query tiles
    # include ``tile``, where sequence b's tiles start at cu_seqlens_q[b] // Q_PER_TILE + b
    tile_owner: Any
    fp8_value: Any  # (e4m3fn bits) -> their value / 256 as fp16
    # (counter_ptr, total) -> whether this program is the last of the ``total`` that count at ``counter_ptr``
    # (which it then resets): it goes on with what they stored before counting (read with cache_modifier=".cg")
    last_to_arrive: Any
    # (device, user, count) -> ``count`` zeroed counters for last_to_arrive, left at zero by the kernels; None
    # inside a graph capture that needs more than were allocated before it (the caller launches a kernel more)
    counters: Callable[[torch.device, str, int], Tensor | None]


class DeviceHooks(Protocol):
    """What the core and kernels ask a backend about its device, beyond the ops."""

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """An empty host tensor for copies to the device (pinned where that lets a copy not
        wait)."""

    def launch_chain(self, device: torch.device) -> dict[str, Any]:
        """Launch arguments with which a Triton kernel on ``device`` joins this backend's
        launch chain (see :mod:`xinfer.kernel_api`): ``ENTER``, a ``@triton.jit`` function of
        no arguments the kernel calls first, and launch options."""

    def kernel_helpers(self) -> KernelHelpers:
        """The ``@triton.jit`` functions this backend lends plugins' Triton kernels."""


class Ops(DeviceHooks, Protocol):
    """What a backend provides: every op below, and what it supports beyond them, checked
    at start-up (:func:`xinfer.backend.check_support`). :class:`xinfer.torch_ops.TorchOps`
    is the reference of every op; a backend subclasses it and overrides op by op."""

    name: str  # as in the backend's BackendSpec
    kv_formats: frozenset[str] | None  # the KV cache formats attention supports; None: every one
    recent_window: bool  # attention keeps a recent window exact (KeepsRecentWindow)
    weight_kernels: Mapping[str, str]  # quantized weight format -> "module:attribute" of its WeightKernels
    expert_activations: frozenset[str] | None  # the activations fused_moe computes; None: every one

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        """``x @ weight.T + bias`` for ``x`` [T, K] and ``weight`` [N, K] (a float tensor: quantized
        weights go to the kernels of ``weight_kernels``, see :mod:`xinfer.quant.dispatch`)."""

    def rms_norm(
        self, x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
    ) -> Tensor | tuple[Tensor, Tensor]:
        """``x * rsqrt(mean(x^2) + eps) * weight``, computed in fp32.

        With ``residual``, normalizes ``x + residual`` and also returns that sum
        (the next residual).
        """

    def norm_linear(
        self,
        x: Tensor,
        residual: Tensor | None,
        norm_weight: Tensor,
        eps: float,
        weight: Tensor,
        bias: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """A norm and the linear it feeds as one op, ``(y, normed, h)`` for ``x`` [T, K]::

            h      = x + residual                      # x itself without a residual
            normed = rms_norm(h, norm_weight, eps)     # as :meth:`rms_norm`, in x's dtype
            y      = linear(normed, weight, bias)      # normed cast to weight's dtype first

        so that a backend may normalize in the linear's prologue (decode steps of small
        batches: the norm's own launch costs more than its bytes). ``normed`` and ``h``
        serve what else reads the normalized input and the next residual."""

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
        """A norm, the router's projection it feeds and the routing as one op, ``(weights,
        ids, normed, h)``: :meth:`norm_linear` of ``x`` into the router's ``weight`` (its
        logits in the weight's dtype), then :meth:`moe_route` of those logits. At batch 1
        a backend may do it in one launch (the routing in the last program's epilogue)."""

    def layer_norm(
        self, x: Tensor, weight: Tensor, bias: Tensor, eps: float, residual: Tensor | None = None
    ) -> Tensor | tuple[Tensor, Tensor]:
        """``(x - mean(x)) * rsqrt(var(x) + eps) * weight + bias`` over the last dim (vision
        towers), computed in fp32. With ``residual``, normalizes ``x + residual`` (rounded to the
        input dtype) and also returns that sum (the next residual), as :meth:`rms_norm` does."""

    def rotary(
        self, q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor, norms: HeadNorms | None = None
    ) -> tuple[Tensor, Tensor]:
        """Rotate the first ``R`` dims of each head of ``q`` [T, H, D] and ``k`` [T, Hkv, D]
        in rotate-half (NeoX) form; ``cos_sin`` is [max_pos, R] as cos || sin halves.

        With ``norms``, each head is first normalized as :meth:`rms_norm` would, its
        result rounded to the input dtype, so one kernel does what two norms and the
        rotation did."""

    def silu_and_mul(self, x: Tensor) -> Tensor:
        """``silu(x[..., :n]) * x[..., n:]`` for ``x`` [T, 2n]."""

    def gelu_tanh_and_mul(self, x: Tensor) -> Tensor:
        """``gelu_tanh(x[..., :n]) * x[..., n:]`` for ``x`` [T, 2n]."""

    def gelu_and_mul(self, x: Tensor) -> Tensor:
        """``gelu(x[..., :n]) * x[..., n:]`` for ``x`` [T, 2n], the exact (erf) gelu."""

    def sigmoid_gate(self, y: Tensor, gate: Tensor) -> Tensor:
        """``sigmoid(gate) * y`` for ``y`` and ``gate`` [T, N] (an attention's output gate), computed
        in fp32 and rounded once to the dtype of ``y``."""

    def add_gated(self, base: Tensor, y: Tensor, x: Tensor, gate_weight: Tensor) -> Tensor:
        """``base + sigmoid(x @ gate_weight.T) * y`` for ``base``, ``y`` [T, N], ``x`` [T, K] and
        ``gate_weight`` [1, K] (a float tensor): a shared expert scaled by its gate and added to
        the routed experts' output, in fp32 (the gate's logit too), rounded once to the dtype of
        ``base``. One op, so that a backend does in one launch what were four (the gate's
        one-row projection, sigmoid, product and sum)."""

    def fused_moe(
        self,
        x: Tensor,
        w13: Tensor,
        w2: Tensor,
        topk_weights: Tensor,
        topk_ids: Tensor,
        activation: str,
        limit: float | None = None,
        shared_experts: int = 0,
    ) -> Tensor:
        """The routed experts of a mixture-of-experts block: token ``t`` of ``x`` [T, H] goes
        through experts ``topk_ids[t]`` [k] and their outputs are summed, weighted by
        ``topk_weights[t]`` [k] (fp32)::

            out[t] = sum_j topk_weights[t, j] * w2[e] @ act_and_mul(w13[e] @ x[t]),  e = topk_ids[t, j]

        With ``limit`` (a clamped SwiGLU: DeepSeek V4's ``swiglu_limit``), the gate is clamped to at
        most ``limit`` and the up projection to ``[-limit, limit]`` before ``act_and_mul``.

        ``w13`` [E, 2I, H] holds each expert's gate rows then its up rows, ``w2`` [E, H, I];
        ``activation`` names ``act`` as HF configs do: a key of :data:`xinfer.activations.ACTIVATIONS`, of
        ``expert_activations`` where the backend declares them (start-up refuses the others).
        The sum is in fp32; returns [T, H] in the dtype of ``x``. No host syncs on CUDA,
        so that it is captured in CUDA graphs; every id in ``topk_ids`` is a valid expert.

        ``shared_experts`` n: the last n experts are every token's, its last n slots
        (``Routing.shared_experts``). The result is the same; a backend may compute them apart
        (the CUDA backend's grouped path: as dense GEMMs over all the tokens)."""

    def moe_route(self, logits: Tensor, routing: Routing, correction_bias: Tensor | None) -> tuple[Tensor, Tensor]:
        """Each token's ``routing.top_k`` experts and their weights from its router logits
        [T, E]: scores, the correction ``correction_bias`` [E] (fp32) adds for the choice
        alone, the group limit, renormalization and the scaling factor, as
        :mod:`xinfer.layers.moe` writes them. Returns the weights [T, k] (fp32) and the
        ids [T, k] (an integer dtype), best first. A fixed table and a per-expert scale
        are the router's own (``routing.fixed_table`` and ``per_expert_scale`` are ignored).

        With ``routing.shared_experts`` n, each token's k routed experts are followed by experts
        E .. E + n - 1, weighted 1, or, with ``routing.shared_gate``, by the sigmoid of the token's
        last logit (``logits`` is then [T, E + 1], the last column no expert's): [T, k + n] each
        (:func:`xinfer.torch_ops.with_shared_experts`)."""

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
        """Store this step's ``k``, ``v`` [T, Hkv, D] in ``cache`` at ``meta.slot_mapping``
        (negative: skipped), then causal paged attention of ``q`` [T, H, D] over each
        sequence's cached KV, this step's included. One op, so that a backend may fuse
        the store with work on the queries.

        The store is in the cache's format: the tensors of ``cache.format.quantize(k, v,
        cache.dtype, cache.equalizer, cache.key_offset)``, each [num_blocks, block_size,
        Hkv, ...]; with shadow blocks (``cache.shadows`` and ``meta.shadows``) also
        exactly into them, as :meth:`KeepsRecentWindow.write_shadow_kv` does.

        Quantized formats are read in place (dequantized inside the op, never into a
        full-precision copy of the cache); for formats that rotate keys the query is
        scaled and rotated the same way (``cache.format.prepare_query(q,
        cache.equalizer)``), so scores are unchanged; where values are rotated the
        output is rotated back (``cache.format.finish_output``). Stored keys lack the
        layer's ``key_offset``, which moves a query's scores alike: nothing to undo.

        A query at position ``p`` sees keys at positions ``p - window < j <= p``
        (all ``j <= p`` without a window); with ``meta.key_limits``, ``j <= p`` becomes
        ``j <= key_limits[row]`` (the window's lower bound stays). With ``softcap``, scores become
        ``softcap * tanh(scores / softcap)`` before masking. Returns [T, H, D].

        With shadow blocks (``cache.recent_window`` W > 0 and ``meta.shadows``),
        key ``j`` comes from its block's shadow where the sequence has one and
        ``p - j < W`` or ``j`` is in the sequence's first block; from the quantized
        cache otherwise.
        """

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
        """:meth:`rotary` of ``q`` and ``k`` by ``rotation``, then :meth:`attention` of the
        rotated pair and ``v``. One op, so that a backend may store the rotated keys and the
        values straight into the cache from the rotation's pass (no rotated copy of k)."""

    def encoder_attention(self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, scale: float) -> Tensor:
        """Non-causal attention within each segment of a flat batch (the patches of one image in
        a vision encoder): rows ``cu_seqlens[b]:cu_seqlens[b+1]`` of ``q`` [T, H, D] attend to
        the same rows of ``k``, ``v`` [T, Hkv, D], every key visible. No cache. Returns [T, H, D]
        in the dtype of ``q``."""

    def sample(self, logits: Tensor, params: SamplingBatch) -> Tensor:
        """Token ids [B] drawn from ``logits`` [B, vocab] (any float dtype), row ``b`` with
        row ``b`` of ``params``: greedy rows take their argmax (the first on ties), the
        others draw exactly what :mod:`xinfer.torch_sampling` defines, from its noise, so
        every backend draws the same tokens. No host synchronisation: a backend that
        records steps records the sampling with the forward."""

    def apply_token_bitmask(self, logits: Tensor, bitmask: Tensor, rows: Tensor) -> None:
        """Grammar masks, in place: in row ``rows[i]`` of ``logits`` [B, vocab], every token
        ``t`` whose bit ``t % 32`` of ``bitmask[i, t // 32]`` (int32 [R, words]) is 0 becomes
        ``-inf``, and so does every token past the bitmask's ``32 * words``. Rows not in
        ``rows`` [R] (int64) are untouched. One op for the batch's constrained rows."""


@dataclass
class PageBatch:
    """A step's cache slots and block tables in one page group (host lists)."""

    slot_mapping: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)  # one row per sequence, unpadded
    shadows: PageBatch | None = None  # with a recent window: the shadow blocks' slots and tables


@dataclass
class HostBatch:
    """A step's inputs as host lists, before they are copied to the device."""

    input_ids: list[int]
    positions: list[int]
    cu_seqlens_q: list[int]
    seq_lens: list[int]
    sample_rows: list[int]  # rows of the flat batch whose logits are sampled
    pages: list[PageBatch]  # one per page group
    state_slots: list[int] = field(default_factory=list)  # per sequence, with recurrent layers
    # the encoder embeddings the step's prompt chunks cover (MultiModalSlice); such a step runs eagerly
    multimodal: list[Any] = field(default_factory=list)
    key_limits: list[int] = field(default_factory=list)  # per row, or none (AttentionMetadata.key_limits)

    @property
    def is_decode(self) -> bool:
        """One token per sequence, each sampled."""
        return len(self.sample_rows) == len(self.input_ids)

    @property
    def max_blocks(self) -> int:
        """The longest block table of the step (0 where the model pages nothing)."""
        return max((len(row) for page in self.pages for row in page.block_tables), default=0)


@dataclass
class StepContext:
    """What a step's caching layers read: the attention metadata of each page group (one
    :func:`without_kv` where the model has none), and each sequence's recurrent-state slot."""

    pages: list[AttentionMetadata]
    state_slots: Tensor | None = None  # [B] int32
    multimodal: Any = None  # MultiModalEmbeddings of the step's image tokens, if any
    derived: dict[str | tuple, Any] = field(default_factory=dict)  # computed once a forward, read by every layer

    @property
    def seqs(self) -> AttentionMetadata:
        """The metadata every group shares (query rows and context lengths)."""
        return self.pages[0]


@dataclass
class DeviceTokens:
    """Input ids of a step that are still on the device (sampled by the step before
    it and not yet read back): ``input_ids[index] = values``."""

    index: Tensor
    values: Tensor

    def write_into(self, input_ids: Tensor) -> None:
        input_ids.index_copy_(0, self.index, self.values)


StepForward = Callable[[Tensor, Tensor, StepContext, Tensor], Tensor]
"""(input ids, positions, step context, sample rows) -> logits of those rows."""
StepRunner = Callable[[HostBatch, "DeviceTokens | None", "list[SampledRow]"], "tuple[Tensor, Tensor] | None"]


@dataclass(frozen=True)
class StepLimits:
    """The largest step an engine runs."""

    max_num_seqs: int
    max_num_tokens: int
    max_blocks_per_seq: int
    max_seq_len: int
    num_page_groups: int = 1
    shadows: bool = False  # steps carry shadow tables and slots (a recent window)
    state_slots: bool = False  # steps carry recurrent-state slots


class KeepsRecentWindow(Protocol):
    """What a backend declaring ``recent_window`` provides besides its attention reading
    shadow blocks (the recent window of a quantized cache, ``cache.shadows``; see
    :meth:`Ops.attention`)."""

    def write_shadow_kv(self, k: Tensor, v: Tensor, cache: LayerKVCache, shadow_slots: Tensor) -> None:
        """Store ``k``, ``v`` [T, Hkv, D] exactly into ``cache``'s shadow blocks: in the
        basis the format stores them in (``cache.format.stored_basis``), in the model dtype."""


class CapturesSteps(Protocol):
    """Optional: a backend that can record steps and replay them cheaply."""

    def capture_steps(self, forward: StepForward, limits: StepLimits, device: torch.device) -> StepRunner:
        """Record ``forward`` for steps up to ``limits`` (decode steps and steps with
        prompt tokens). The returned runner computes the logits [len(sample_rows), vocab]
        of a :class:`HostBatch` (with its :class:`DeviceTokens` written in) and the tokens
        :meth:`Ops.sample` draws from them for its sampled rows, or returns None for a
        batch it cannot take."""


_current: Ops | None = None


@contextmanager
def use(ops: Ops) -> Iterator[None]:
    """Compute with ``ops`` inside the block (engines in one process may differ)."""
    global _current
    previous, _current = _current, ops
    try:
        yield
    finally:
        _current = previous


def current() -> Ops:
    if _current is None:
        raise RuntimeError("no backend in use: call xinfer.ops.use(...) first")
    return _current


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    if isinstance(weight, QuantizedTensor):
        return quantized.linear(current(), x, weight, bias)
    return current().linear(x, weight, bias)


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None):
    return current().rms_norm(x, weight, eps, residual)


def norm_linear(
    x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    if isinstance(weight, QuantizedTensor):
        return quantized.norm_linear(current(), x, residual, norm_weight, eps, weight, bias)
    return current().norm_linear(x, residual, norm_weight, eps, weight, bias)


def norm_route(
    x: Tensor,
    residual: Tensor | None,
    norm_weight: Tensor,
    eps: float,
    weight: Tensor,
    routing: Routing,
    correction_bias: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if isinstance(weight, QuantizedTensor):
        logits, normed, h = norm_linear(x, residual, norm_weight, eps, weight)
        return *moe_route(logits, routing, correction_bias), normed, h
    return current().norm_route(x, residual, norm_weight, eps, weight, routing, correction_bias)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float, residual: Tensor | None = None):
    return current().layer_norm(x, weight, bias, eps, residual)


def rotary(
    q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor, norms: HeadNorms | None = None
) -> tuple[Tensor, Tensor]:
    return current().rotary(q, k, positions, cos_sin, norms)


def silu_and_mul(x: Tensor) -> Tensor:
    return current().silu_and_mul(x)


def gelu_tanh_and_mul(x: Tensor) -> Tensor:
    return current().gelu_tanh_and_mul(x)


def gelu_and_mul(x: Tensor) -> Tensor:
    return current().gelu_and_mul(x)


GATED_OPS = {"silu": "silu_and_mul", "gelu_pytorch_tanh": "gelu_tanh_and_mul", "gelu": "gelu_and_mul"}
"""The backend op of each fused ``act(gate) * up``, by the config's name of ``act``."""


def act_and_mul_of(backend: Ops, activation: str) -> Callable[[Tensor], Tensor]:
    """``act(gate) * up`` for the ``activation`` a config names (a key of :data:`xinfer.activations.ACTIVATIONS`):
    ``backend``'s op where :data:`GATED_OPS` has one, else in torch."""
    if activation in GATED_OPS:
        return getattr(backend, GATED_OPS[activation])
    return functools.partial(act_and_mul, ACTIVATIONS[activation])


def sigmoid_gate(y: Tensor, gate: Tensor) -> Tensor:
    return current().sigmoid_gate(y, gate)


def add_gated(base: Tensor, y: Tensor, x: Tensor, gate_weight: Tensor) -> Tensor:
    return current().add_gated(base, y, x, gate_weight)


def fused_moe(
    x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor, activation: str,
    limit: float | None = None, shared_experts: int = 0,
) -> Tensor:  # fmt: skip
    if isinstance(w13, QuantizedTensor) or isinstance(w2, QuantizedTensor):
        return quantized.fused_moe(current(), x, w13, w2, topk_weights, topk_ids, activation, limit)
    extras: dict[str, Any] = {"limit": limit} if limit is not None else {}  # (older backends' take neither)
    if shared_experts:
        extras["shared_experts"] = shared_experts
    return current().fused_moe(x, w13, w2, topk_weights, topk_ids, activation, **extras)


def sample(logits: Tensor, params: SamplingBatch) -> Tensor:
    return current().sample(logits, params)


def apply_token_bitmask(logits: Tensor, bitmask: Tensor, rows: Tensor) -> None:
    current().apply_token_bitmask(logits, bitmask, rows)


def encoder_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, scale: float) -> Tensor:
    return current().encoder_attention(q, k, v, cu_seqlens, scale)


def moe_route(logits: Tensor, routing: Routing, correction_bias: Tensor | None) -> tuple[Tensor, Tensor]:
    return current().moe_route(logits, routing, correction_bias)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cache: LayerKVCache,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    return current().attention(q, k, v, cache, meta, scale, window, softcap)


def rotary_attention(
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
    return current().rotary_attention(q, k, v, rotation, cache, meta, scale, window, softcap)


PRIMITIVES = tuple(name for name, value in vars(Ops).items() if callable(value) and not name.startswith("_"))
"""The ops every backend implements (the methods of :class:`Ops`)."""

_plugin_functions: weakref.WeakKeyDictionary[Any, dict[str, Callable | None]] = weakref.WeakKeyDictionary()


def call(name: str, *args: Any, **kwargs: Any) -> Any:
    """Run op ``name`` (a plugin's, or one of :data:`PRIMITIVES`) on the backend in use."""
    return get(name)(*args, **kwargs)


def get(name: str) -> Callable:
    """Op ``name`` as the backend in use runs it: the kernel that the op's plugin registers
    under the backend's name, else the backend's method of that name, else the op's torch
    reference. Resolved once per backend."""
    backend = current()
    functions = _plugin_functions.setdefault(backend, {})
    if name not in functions:
        functions[name] = _plugin_function(backend, name, registry.op_specs())
    return functions[name] or getattr(backend, name)


def activations_of(name: str, backend: Ops) -> frozenset[str] | None:
    """The activations plugin op ``name`` computes on ``backend``, as its :class:`~xinfer.hooks.OpSpec` declares
    them for the backend's kernel; None for every one (the reference, or a kernel that declares none)."""
    spec = registry.op_specs().get(name)
    return None if spec is None else spec.activations.get(backend.name)


def _plugin_function(backend: Ops, name: str, specs: Mapping[str, OpSpec]) -> Callable | None:
    """The plugin's function that runs op ``name`` on ``backend``; None where the backend's
    own method does (kept apart so that the cache holds no reference to the backend)."""
    spec = specs.get(name)
    if spec is None:
        if name in PRIMITIVES:
            return None
        known = ", ".join(sorted({*PRIMITIVES, *specs}))
        raise ValueError(f"unknown op {name!r}; known ops: {known}. Install the plugin that provides it.")
    if backend.name in spec.kernels:
        return registry.load_object(spec.kernels[backend.name])
    if hasattr(backend, name):
        return None
    return registry.load_object(spec.reference)

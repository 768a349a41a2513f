"""Mixture of experts: a router picks ``k`` of ``E`` expert MLPs per token and weighs their
outputs; shared experts (and a dense MLP) see every token.

The router's math (each line switched on by :class:`Routing`), in fp32 as the references do::

    scores  = score(x @ gate.T)                 # softmax, or any plain activation (sigmoid, sqrtsoftplus, ...)
    choice  = scores + e_score_correction_bias  # selection only
    choice  = keep the topk_group best groups   # n_group groups of E / n_group experts, by their two best
    ids     = topk(choice, k)                   #   or tid2eid[token_id]: a fixed table
    weights = scores[ids]
    weights = weights / sum(weights)            # norm_topk_prob
    weights = weights * routed_scaling_factor * per_expert_scale[ids]

Where a ``swiglu_limit`` is given (DeepSeek V4), every expert's gate is clamped to at most it and its
up projection to within it before ``act(gate) * up``, the shared experts' too.

The experts' weights are stacked at load, ``w13`` [E, 2I, H] (gate then up) and ``w2``
[E, H, I], and run as one op (:func:`xinfer.ops.fused_moe`); the router's math but the
fixed table and the per-expert scale is one op too (:func:`xinfer.ops.moe_route`). Once
loaded, float shared experts join the routed ones, and the routing hands every token them
too (:meth:`MoE.finish_loading`). The experts' ``act`` is any activation xinfer knows
(:data:`xinfer.activations.ACTIVATIONS`); start-up refuses one that the backend's
``fused_moe`` lacks (:func:`check_experts_run_on`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import Tensor, nn

from xinfer import ops
from xinfer.distributed.group import Slice, current
from xinfer.layers.activation import activation_name, refuse_uncomputed
from xinfer.layers.linear import FloatLinear
from xinfer.layers.mlp import GatedMLP
from xinfer.layers.norm import RMSNorm
from xinfer.loading.stored import StoredTensor, part_of
from xinfer.quant import QuantizedTensor, cat_rows
from xinfer.torch_ops import SCORING, expert_weights


@dataclass(frozen=True)
class Routing:
    """How a router turns a token into its ``top_k`` experts and their weights (the
    module docstring gives the math; HF config fields in the comments)."""

    top_k: int  # num_experts_per_tok
    scoring: str = "softmax"  # scoring_func
    renormalize: bool = False  # norm_topk_prob
    correction_bias: bool = False  # an e_score_correction_bias
    num_groups: int = 1  # n_group
    topk_groups: int = 1  # topk_group
    scaling_factor: float = 1.0  # routed_scaling_factor
    per_expert_scale: bool = False  # a learned scale per expert on its weight
    fixed_table: bool = False  # experts from a token-id table (tid2eid) instead of the scores
    fp32_logits: bool = False  # the router's GEMM in fp32 (its weight kept in fp32)
    # set at load where the shared experts run as routed ones (MoE.finish_loading): every token also takes
    # experts E .. E + shared_experts - 1, weighted 1, or sigmoid of the router's last logit where shared_gate
    shared_experts: int = 0
    shared_gate: bool = False

    def __post_init__(self):
        if self.scoring not in SCORING:
            raise ValueError(
                f"scoring_func {self.scoring!r} is not a routing function xinfer knows; known: {', '.join(SCORING)}"
            )


class Router(nn.Module):
    """Each token's experts ``ids`` [T, k] and their weights [T, k] (fp32) from hidden
    states ``x`` [T, H] (and, with a fixed table, the tokens' ids)."""

    def __init__(self, hidden_size: int, num_experts: int, vocab_size: int | None, routing: Routing):
        super().__init__()
        if routing.top_k > num_experts:
            raise ValueError(f"num_experts_per_tok {routing.top_k} is more than the {num_experts} experts")
        if num_experts % routing.num_groups or routing.topk_groups > routing.num_groups:
            raise ValueError(
                f"n_group {routing.num_groups} and topk_group {routing.topk_groups} do not fit {num_experts} experts"
            )
        if routing.num_groups > 1 and num_experts // routing.num_groups < 2:  # a group scores by its best two
            raise ValueError(f"n_group {routing.num_groups} leaves one of the {num_experts} experts a group: a group's "
                             f"score is the sum of its best two")  # fmt: skip
        self.routing = routing
        dtype = torch.float32 if routing.fp32_logits else None
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype))
        self.e_score_correction_bias = _vector(num_experts) if routing.correction_bias else None
        self.per_expert_scale = _vector(num_experts) if routing.per_expert_scale else None
        if routing.fixed_table:
            if vocab_size is None:
                raise ValueError("routing by a fixed token-to-expert table needs the vocabulary size")
            # until loaded, every token to top_k distinct experts, the tokens spread over all (dummy weights)
            first = torch.arange(vocab_size, dtype=torch.int64)[:, None] * routing.top_k
            table = (first + torch.arange(routing.top_k)) % num_experts
            self.tid2eid = nn.Parameter(table, requires_grad=False)

    def forward(self, x: Tensor, token_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        logits = ops.linear(x.float(), self.weight) if self.routing.fp32_logits else ops.linear(x, self.weight)
        return self.route(logits, token_ids)

    def forward_norm(
        self, norm: RMSNorm, h: Tensor, residual: Tensor | None, token_ids: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """:meth:`forward` of ``norm(h + residual)`` and, for the experts, that normalized input
        and ``h + residual``: ``(weights, ids, x, residual)``. The norm runs in the router's
        projection, and the routing with them where it is the scores' (:func:`xinfer.ops.norm_route`)."""
        if self.routing.fixed_table:
            logits, x, residual = norm.project(h, residual, self.weight)
            weights, ids = self.route(logits, token_ids)
            return weights, ids, x, residual
        weights, ids, x, residual = ops.norm_route(
            h, residual, norm.weight, norm.eps, self.weight, self.routing, self.e_score_correction_bias
        )
        return self.scaled(weights, ids), ids, x, residual

    def route(self, logits: Tensor, token_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """:meth:`forward` from the router's logits [T, E] (``x @ weight.T``, in the weight's dtype)."""
        routing = self.routing
        if routing.fixed_table:
            assert token_ids is not None, "routing by a fixed table needs the tokens' ids"
            ids = self.tid2eid[token_ids]
            weights = expert_weights(SCORING[routing.scoring](logits.float()), ids, routing)
        else:
            weights, ids = ops.moe_route(logits, routing, self.e_score_correction_bias)
        return self.scaled(weights, ids), ids

    def scaled(self, weights: Tensor, ids: Tensor) -> Tensor:
        """``weights`` times the per-expert scale of ``ids``, where the router has one."""
        return weights if self.per_expert_scale is None else weights * self.per_expert_scale.float()[ids]


def _vector(size: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(size, dtype=torch.float32))


_PER_EXPERT = re.compile(r"(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class Experts(nn.Module):
    """``E`` gated MLPs stacked: ``w13`` [E, 2I, H] (gate rows, then up rows), ``w2`` [E, H, I].

    Loads the checkpoint tensors under it itself (:class:`~xinfer.model.LoadsCheckpoint`):
    one per expert and projection (``{e}.gate_proj.weight``, as HF checkpoints hold them),
    one per projection stacked over the experts (``gate_proj.weight`` [E, I, H], as GGUF
    files hold them), or transformers' fused ``gate_up_proj`` [E, 2I, H] and ``down_proj``.

    Under tensor parallelism every rank holds every expert's part of the intermediate size
    (``I`` is then this rank's), and the output is summed over the ranks.
    """

    quantized_weights: ClassVar[tuple[str, ...]] = ("w13", "w2")  # stacked packed tensors (GGUF's) stay packed

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str, limit: float | None = None,
        activation_field: str = "hidden_act",
    ):  # fmt: skip
        super().__init__()
        self._packed_halves: dict[str, QuantizedTensor] = {}  # gate_proj / up_proj until both are in
        self._packed_experts: dict[str, dict[int, QuantizedTensor]] = {}  # a projection's experts until all are in
        self.limit = limit  # a clamped SwiGLU (ops.fused_moe)
        self.tp = current()
        self.part = self.tp.split(intermediate_size, "the experts' intermediate size")
        self.num_experts, self.intermediate_size = num_experts, self.part.size(intermediate_size)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate_size))
        self.activation = activation_name(activation, activation_field)
        self.activation_field = activation_field  # the config's name of it, for start-up's one error

    @property
    def shared_experts(self) -> int:
        """The experts of ``w13`` / ``w2`` past the routed ones: every token's (:meth:`MoE.finish_loading`)."""
        return self.w13.shape[0] - self.num_experts

    def forward(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        out = ops.fused_moe(x, self.w13, self.w2, weights, ids, self.activation, self.limit, self.shared_experts)
        return self.tp.all_reduce(out)

    def checkpoint_parts(self) -> set[str]:
        return {f"{e}.{p}.weight" for e in range(self.num_experts) for p in _PROJECTIONS}

    def checkpoint_names(self) -> set[str]:
        return self.checkpoint_parts() | {f"{p}.weight" for p in _PROJECTIONS} | {"gate_up_proj", "down_proj"}

    def load_checkpoint(self, name: str, stored: Tensor | StoredTensor) -> set[str]:
        if isinstance(stored, QuantizedTensor):
            if name in ("gate_proj.weight", "up_proj.weight", "down_proj.weight") and self.part.whole:
                return self._load_packed(name.split(".")[0], stored)
            if name in ("gate_up_proj", "down_proj") and self.part.whole:  # fused, as gpt-oss' MXFP4 stores them
                return self._load_packed_fused(name, stored)
            if (match := _PER_EXPERT.fullmatch(name)) and self.part.whole and 0 <= int(match[1]) < self.num_experts:
                return self._load_packed_expert(int(match[1]), match[2], stored)
            stored = stored.dequantize()
        experts: slice | int
        if match := _PER_EXPERT.fullmatch(name):
            experts, projection = int(match[1]), match[2]
        elif name in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"):
            experts, projection = slice(None), name.split(".")[0]
        elif name in ("gate_up_proj", "down_proj"):
            experts, projection = slice(None), name
        else:
            raise ValueError(f"experts: no parameter loads checkpoint tensor {name!r}")
        if isinstance(experts, int) and not 0 <= experts < self.num_experts:
            raise ValueError(f"experts: checkpoint tensor {name!r} is beyond the {self.num_experts} experts")
        tensor = part_of(stored, self._rank_slice(projection, stored.shape))
        size = self.intermediate_size
        rows = {"gate_proj": slice(0, size), "up_proj": slice(size, 2 * size), "gate_up_proj": slice(None)}
        param = self.w2 if projection == "down_proj" else self.w13
        target = param.data[experts] if projection == "down_proj" else param.data[experts, rows[projection]]
        if target.shape != tensor.shape:
            raise ValueError(
                f"weight {name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(tensor)
        filled = range(self.num_experts)[experts] if isinstance(experts, slice) else [experts]
        projections = ("gate_proj", "up_proj") if projection == "gate_up_proj" else (projection,)
        return {f"{e}.{p}.weight" for e in filled for p in projections}

    def _load_packed_expert(self, expert: int, projection: str, tensor: QuantizedTensor) -> set[str]:
        """One expert's packed projection (FP8 checkpoints store experts one by one): kept until every
        expert's is in, then stacked packed (as floats where their formats differ)."""
        arrived = self._packed_experts.setdefault(projection, {})
        arrived[expert] = tensor
        if len(arrived) == self.num_experts:
            del self._packed_experts[projection]
            experts = [arrived[e] for e in range(self.num_experts)]
            if all(e.format.name == experts[0].format.name and not e.parts for e in experts):
                raw = torch.stack([e.raw for e in experts])
                self._load_packed(
                    projection, QuantizedTensor(raw, experts[0].format, (len(experts), *tensor.logical_shape))
                )
            else:
                for e, packed in enumerate(experts):
                    self.load_checkpoint(f"{e}.{projection}.weight", packed.dequantize())
        return {f"{expert}.{projection}.weight"}

    def _load_packed(self, projection: str, tensor: QuantizedTensor) -> set[str]:
        """A projection stacked over the experts, kept packed: ``w2`` at once, ``w13`` once gate and up
        are both in (as floats where their formats differ)."""
        if projection == "down_proj":
            self._check(projection, tensor.logical_shape, self.w2.shape)
            self.w2 = nn.Parameter(tensor.to(self.w2.device), requires_grad=False)
        else:
            self._check(projection, tensor.logical_shape, (self.num_experts, self.intermediate_size, self.w13.shape[2]))
            self._packed_halves[projection] = tensor
            if len(self._packed_halves) == 2:
                gate, up = self._packed_halves.pop("gate_proj"), self._packed_halves.pop("up_proj")
                if gate.format.name == up.format.name:
                    self.w13 = nn.Parameter(cat_rows([gate, up]).to(self.w13.device), requires_grad=False)
                else:
                    with torch.no_grad():
                        self.w13.copy_(torch.cat([gate.dequantize(), up.dequantize()], dim=1))
        return {f"{e}.{projection}.weight" for e in range(self.num_experts)}

    def _load_packed_fused(self, name: str, tensor: QuantizedTensor) -> set[str]:
        """transformers' fused ``gate_up_proj`` [E, 2I, H] (gate rows, then up rows) or ``down_proj``, packed."""
        if name == "down_proj":
            return self._load_packed(name, tensor)
        self._check(name, tensor.logical_shape, self.w13.shape)
        self.w13 = nn.Parameter(tensor.to(self.w13.device), requires_grad=False)
        return {f"{e}.{p}.weight" for e in range(self.num_experts) for p in ("gate_proj", "up_proj")}

    def _check(self, projection: str, got: tuple[int, ...], expected: tuple[int, ...]) -> None:
        if tuple(got) != tuple(expected):
            raise ValueError(
                f"weight {projection}.weight: checkpoint shape {tuple(got)} != model shape {tuple(expected)}"
            )

    def _rank_slice(self, projection: str, shape: torch.Size) -> Slice:
        """This rank's part of the intermediate size: rows of gate and up (of each half of a fused
        ``gate_up_proj``), columns of down."""
        if projection == "down_proj":
            return self.part.slice(shape[-1], dim=-1)
        dim = len(shape) - 2
        if projection == "gate_up_proj":
            half = shape[dim] // 2
            return Slice(dim, self.part.ranges(half) + self.part.ranges(half, offset=half))
        return self.part.slice(shape[dim], dim)


def check_experts_run_on(model: nn.Module, backend: ops.Ops) -> None:
    """One error, naming the config's field, where ``model``'s experts take an activation that ``backend``'s
    ``fused_moe`` does not compute (its ``expert_activations``)."""
    for experts in (m for m in model.modules() if isinstance(m, Experts)):
        refuse_uncomputed(experts.activation, experts.activation_field, backend.expert_activations, "the experts",
                          backend)  # fmt: skip


class MoE(nn.Module):
    """The MLP block of an MoE layer: routed experts, plus (where given) shared experts
    (``shared_expert``: a gated MLP on every token, scaled by ``sigmoid(shared_expert_gate(x))``
    where gated) and a dense MLP in parallel (``dense_mlp``).

    Checkpoint names are HF's: ``gate`` (the router), ``experts``, ``shared_expert``,
    ``shared_expert_gate``; ``shared_name`` renames the shared experts (``shared_experts``
    in GLM and DeepSeek), whose projections have biases where ``shared_bias`` (DeepSeek-V2's
    ``mlp_bias``). ``swiglu_limit`` clamps the routed and shared experts' gate and up
    projections (DeepSeek V4).
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        intermediate_size: int,
        routing: Routing,
        activation: str = "silu",
        *,
        shared_intermediate_size: int = 0,
        shared_expert_gate: bool = False,
        shared_name: str = "shared_expert",
        shared_bias: bool = False,
        dense_intermediate_size: int = 0,
        vocab_size: int | None = None,
        swiglu_limit: float | None = None,
    ):
        super().__init__()
        self.gate = Router(hidden_size, num_experts, vocab_size, routing)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, activation, swiglu_limit)
        self.shared_name = shared_name
        if shared_intermediate_size:
            shared = GatedMLP(hidden_size, shared_intermediate_size, activation, shared_bias, swiglu_limit)
            setattr(self, shared_name, shared)
        # one row, whose weight ops.add_gated reads as it is
        self.shared_expert_gate = FloatLinear(hidden_size, 1) if shared_expert_gate else None
        self.dense_mlp = GatedMLP(hidden_size, dense_intermediate_size, activation) if dense_intermediate_size else None

    def forward(self, x: Tensor, token_ids: Tensor | None = None) -> Tensor:
        return self.mix(x, *self.gate(x, token_ids))

    def forward_norm(
        self, norm: RMSNorm, h: Tensor, residual: Tensor | None, token_ids: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """:meth:`forward` of ``norm(h + residual)``, the norm in the router's projection (which
        also writes the normalized rows the experts read; :meth:`Router.forward_norm`), and
        ``h + residual``."""
        weights, ids, x, residual = self.gate.forward_norm(norm, h, residual, token_ids)
        return self.mix(x, weights, ids), residual

    def finish_loading(self) -> None:
        """Run the shared experts as routed experts that every token takes, where every weight
        involved is plain float (:class:`~xinfer.model.FinishesLoading`). A gated MLP is a sum over
        its intermediate rows, so the shared MLP's rows split into ``n`` experts of the routed
        experts' size and stacked after them in ``w13`` and ``w2`` give the same output; its gate's
        row goes after the router's. The routing then adds them to each token's experts
        (``Routing.shared_experts``, ``shared_gate``): one expert launch where a batch-1 step had
        the shared MLP's two projections, its activation and the sum (or gated sum) besides."""
        shared = getattr(self, self.shared_name, None)
        if shared is None or not self._fuses(shared):
            return
        experts, router = self.experts, self.gate
        gate, up = shared.gate_up_proj.weight.unflatten(0, (2, -1, experts.intermediate_size))  # [n, I, H] each
        down = shared.down_proj.weight.unflatten(1, (-1, experts.intermediate_size)).transpose(0, 1)  # [n, H, I]
        # both new tensors before either old one goes: the old w13's cached block would take the new w2
        w13, w2 = torch.cat((experts.w13, torch.cat((gate, up), dim=1))), torch.cat((experts.w2, down))
        experts.w13, experts.w2 = nn.Parameter(w13, requires_grad=False), nn.Parameter(w2, requires_grad=False)
        if self.shared_expert_gate is not None:
            gate_row = self.shared_expert_gate.weight.to(router.weight.dtype)
            router.weight = nn.Parameter(torch.cat((router.weight, gate_row)), requires_grad=False)
        router.routing = replace(router.routing, shared_experts=gate.shape[0],
                                 shared_gate=self.shared_expert_gate is not None)  # fmt: skip
        delattr(self, self.shared_name)
        self.shared_expert_gate = None

    def _fuses(self, shared: GatedMLP) -> bool:
        """Whether the shared MLP can run as routed experts: unbiased, its intermediate rows a
        multiple of the experts', no routing the kernels leave to the router (a fixed table, a
        per-expert scale), and every weight involved float in the experts' dtype."""
        routing, experts = self.gate.routing, self.experts
        stacked = [experts.w13, experts.w2, shared.gate_up_proj.weight, shared.down_proj.weight]
        return (
            shared.gate_up_proj.bias is None and shared.down_proj.bias is None
            and shared.down_proj.weight.shape[1] % experts.intermediate_size == 0
            and not (routing.fixed_table or routing.per_expert_scale or routing.shared_experts)
            and not any(isinstance(w, QuantizedTensor) for w in [*stacked, self.gate.weight])
            and len({w.dtype for w in stacked}) == 1
        )  # fmt: skip

    def mix(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """The experts' weighted outputs for ``x`` [T, H] routed to ``ids``, and the shared
        experts' and the dense MLP's."""
        out = self.experts(x, weights, ids)
        shared = getattr(self, self.shared_name, None)
        if shared is not None:
            y = shared(x)
            if self.shared_expert_gate is None:
                out = out + y
            else:
                out = ops.add_gated(out, y, x, self.shared_expert_gate.weight)
        if self.dense_mlp is not None:
            out = out + self.dense_mlp(x)
        return out

"""The fused-MoE and routing kernels against the plain-torch references (``TorchOps.fused_moe``,
``TorchOps.moe_route``), on the device ``XINFER_KERNEL_DEVICE`` picks (on "cpu" under the
Triton interpreter; see tests/conftest.py and test_cuda_kernels.py for the tolerances' reasoning).

Routings are random with distinct experts per token; the step sizes cover the per-slot
path (T*k up to 32: decode) and the grouped one (prefill sizes, a decode step of about 16
slots per expert, experts that get no slot or are not a power of two, blocks padded)."""

from __future__ import annotations

import os

import pytest
import torch

from xinfer import ops
from xinfer.layers import RMSNorm
from xinfer.layers.moe import Router, Routing
from xinfer.torch_ops import TorchOps
from xinfer_cuda import moe_tiles
from xinfer_cuda.kernels import arrivals, moe, moe_routing, norm_linear
from xinfer_cuda.linear import ONE_PASS_TILES, ONE_ROW_TILES, SmallBatchLinear
from xinfer_cuda.ops import CudaOps

DEVICE = torch.device(os.environ["XINFER_KERNEL_DEVICE"])
ON_GPU = DEVICE.type == "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

# (tokens, experts, top_k, hidden, intermediate)
SHAPES = [
    (1, 8, 2, 64, 48),
    (3, 16, 4, 64, 48),
    (4, 8, 8, 96, 40),
    (9, 64, 4, 64, 48),
    (37, 16, 4, 64, 48),
    (37, 20, 4, 64, 48),
    (64, 16, 4, 64, 48),
    (130, 8, 2, 80, 64),
]
if ON_GPU:
    SHAPES += [(1, 128, 8, 2048, 768), (512, 128, 8, 2048, 768)]  # Qwen3-30B-A3B: a decode and a prefill step


def routing(tokens: int, experts: int, top_k: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=generator)
    return weights / weights.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-E{}-k{}-H{}-I{}".format(*s))
def test_fused_moe_matches_the_reference(shape, dtype, activation):
    tokens, experts, top_k, hidden, inter = shape
    generator = torch.Generator().manual_seed(tokens * 131 + experts)
    x = torch.randn(tokens, hidden, generator=generator)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=generator) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=generator) * inter**-0.5
    weights, ids = routing(tokens, experts, top_k, generator)
    expected = TorchOps().fused_moe(*(t.to(dtype).float() for t in (x, w13, w2)), weights, ids, activation)
    got = moe.fused_moe(*(t.to(DEVICE, dtype) for t in (x, w13, w2)), weights.to(DEVICE), ids.to(DEVICE), activation)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    assert got.isfinite().all()
    error = (got.cpu().double() - expected.double()).norm() / expected.double().norm()
    assert error <= TOL[dtype], f"relative error {error:.2e}"


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[4]], ids=("per-slot", "grouped"))
def test_fused_moe_with_exact_gelu_matches_the_reference(shape):
    """The exact (erf) gelu, on one shape of each path (the activation is one jit function both call)."""
    test_fused_moe_matches_the_reference(shape, torch.float32, "gelu")


SLOT_TILES = {  # the per-slot path's variants (benchmarks/moe_kernels.py times them), at the interpreter's sizes
    "first": moe.SlotTiles(up_n=16, up_k=32, down_n=16, down_k=32, pipelined=False),
    "pipelined": moe.SlotTiles(up_n=16, up_k=32, down_n=16, down_k=32, up_unroll=2, down_unroll=2),
    "slot-per-program": moe.SlotTiles(up_n=16, up_k=16, down_n=32, down_k=16, down_j=1),
    "split": moe.SlotTiles(up_n=32, up_k=16, down_n=16, down_k=16, down_j=2, down_split=3),
    "fused": moe.SlotTiles(up_n=32, up_k=32, down_n=32, down_k=32, fused=True),
}


@pytest.mark.parametrize("variant", SLOT_TILES)
@pytest.mark.parametrize("shape", [(2, 8, 3, 64, 48), (4, 8, 8, 96, 40), (9, 16, 4, 32, 32)],
                         ids=lambda s: "T{}-E{}-k{}-H{}-I{}".format(*s))  # fmt: skip
def test_per_slot_variants_match_the_reference(shape, variant):
    """Slots split unevenly over programs (k = 3 in pairs), I unevenly over chunks (40 in 3), and a
    step past the per-slot path's size, which ``tiles`` takes through it anyway."""
    tokens, experts, top_k, hidden, inter = shape
    generator = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=generator)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=generator) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=generator) * inter**-0.5
    weights, ids = routing(tokens, experts, top_k, generator)
    expected = TorchOps().fused_moe(x, w13, w2, weights, ids, "silu")
    got = moe.fused_moe(*(t.to(DEVICE) for t in (x, w13, w2, weights, ids)), "silu", SLOT_TILES[variant])
    torch.testing.assert_close(got.cpu(), expected, rtol=TOL[torch.float32], atol=TOL[torch.float32])
    if SLOT_TILES[variant].fused:  # its sums and counter left at zero for the next call
        assert not arrivals.counters(DEVICE, "fused_moe_sums", 1, torch.float32).any()
        assert not arrivals.counters(DEVICE, "fused_moe", 1).any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "tokens", [3, 12, 37, 130], ids=["per-slot", "grouped-few-rows", "grouped", "grouped-more-rows"]
)
@pytest.mark.parametrize("shared", [1, 2])
def test_shared_experts_every_token_takes_match_the_reference(shared, tokens, dtype):
    """Shared experts run as routed ones (MoE.finish_loading): the last experts, in every token's last
    slots, weighted by a gate; the grouped path computes them in its blocks where the tokens fit one (12
    rows), else as dense GEMMs (by the backend's linears), the per-slot path as slots."""
    experts, top_k, hidden, inter = 16, 4, 64, 48
    generator = torch.Generator().manual_seed(tokens + shared)
    x = torch.randn(tokens, hidden, generator=generator)
    w13 = torch.randn(experts + shared, 2 * inter, hidden, generator=generator) * hidden**-0.5
    w2 = torch.randn(experts + shared, hidden, inter, generator=generator) * inter**-0.5
    routed_weights, routed_ids = routing(tokens, experts, top_k, generator)
    gate = torch.rand(tokens, 1, generator=generator).expand(-1, shared)
    weights = torch.cat((routed_weights, gate), dim=1)
    ids = torch.cat((routed_ids, torch.arange(experts, experts + shared).expand(tokens, -1)), dim=1)
    expected = TorchOps().fused_moe(*(t.to(dtype).float() for t in (x, w13, w2)), weights, ids, "silu")
    on = [t.to(DEVICE, dtype) for t in (x, w13, w2)]
    got = CudaOps().fused_moe(*on, weights.to(DEVICE), ids.to(DEVICE, torch.int32), "silu", shared_experts=shared)
    assert got.dtype == dtype
    error = (got.cpu().double() - expected.double()).norm() / expected.double().norm()
    assert error <= TOL[dtype], f"relative error {error:.2e}"


@pytest.mark.parametrize("tokens", [3, 37], ids=["per-slot", "grouped"])
def test_fused_moe_takes_the_int32_ids_the_router_kernel_gives(tokens):
    generator = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 64, generator=generator)
    w13, w2 = torch.randn(16, 96, 64, generator=generator) / 8, torch.randn(16, 64, 48, generator=generator) / 7
    weights, ids = routing(tokens, 16, 4, generator)
    expected = TorchOps().fused_moe(x, w13, w2, weights, ids, "silu")
    got = moe.fused_moe(*(t.to(DEVICE) for t in (x, w13, w2, weights)), ids.to(DEVICE, torch.int32), "silu")
    torch.testing.assert_close(got.cpu(), expected, rtol=TOL[torch.float32], atol=TOL[torch.float32])


@pytest.mark.parametrize("shared", [0, 2])
@pytest.mark.parametrize("tokens, experts, top_k, block_m", [(37, 16, 4, 16), (64, 20, 4, 32), (5, 128, 8, 16)])
def test_align_blocks_puts_every_slot_once_in_the_fewest_blocks_of_its_expert(tokens, experts, top_k, block_m,
                                                                               shared):  # fmt: skip
    """Slots of the ``shared`` experts after the ``experts`` (every token's last slots, computed apart) are in no
    block."""
    generator = torch.Generator().manual_seed(tokens)
    _, ids = routing(tokens, experts, top_k, generator)
    with_shared = torch.cat((ids, torch.arange(experts, experts + shared).expand(tokens, -1)), dim=1)
    block_slots, block_experts = moe.align_blocks(with_shared.to(DEVICE), experts, block_m)
    block_slots, block_experts = block_slots.cpu().view(len(block_experts), block_m), block_experts.cpu()
    flat = with_shared.flatten()
    real = block_slots[block_experts >= 0]
    assert sorted(real[real < flat.numel()].tolist()) == (flat < experts).nonzero().flatten().tolist()
    for slots, expert in zip(block_slots, block_experts.tolist()):
        slots = slots[slots < flat.numel()]
        assert expert >= 0 or slots.numel() == 0
        assert (flat[slots.long()] == expert).all()
    blocks = torch.bincount(block_experts[block_experts >= 0].long(), minlength=experts)
    assert torch.equal(blocks, (torch.bincount(flat[flat < experts], minlength=experts) + block_m - 1) // block_m)


GLM4 = Routing(6, "sigmoid", renormalize=True, correction_bias=True, num_groups=8, topk_groups=3, scaling_factor=2.5)
ROUTINGS = {  # (experts, routing)
    "qwen3": (128, Routing(top_k=8, renormalize=True)),
    "qwen2": (60, Routing(top_k=4)),
    "glm4": (64, GLM4),
    "minimax": (32, Routing(top_k=3, scoring="sigmoid", renormalize=True, correction_bias=True)),
    "deepseek-v4": (64, Routing(4, "sqrtsoftplus", renormalize=True, correction_bias=True, scaling_factor=1.5)),
    # shared experts run as routed ones (MoE.finish_loading): two after DeepSeek-V3's routing, one gated after Qwen3.6's
    "deepseek-v3-shared": (64, Routing(8, "sigmoid", True, True, 8, 4, scaling_factor=2.5, shared_experts=2)),
    "qwen3.6-shared-gate": (64, Routing(top_k=8, renormalize=True, shared_experts=1, shared_gate=True)),
}


def router_columns(experts: int, routing: Routing) -> int:
    """The router's rows: the experts', and the shared experts' gate's where gated."""
    return experts + routing.shared_gate


def assert_shared_experts_follow(weights: torch.Tensor, ids: torch.Tensor, experts: int, routing: Routing,
                                 logits: torch.Tensor) -> None:  # fmt: skip
    """The shared experts come after each token's routed ones, weighted by the gate's logit (or 1)."""
    shared = slice(routing.top_k, None)
    assert torch.equal(ids[:, shared].cpu().long(), torch.arange(experts, experts + routing.shared_experts).expand(
        len(ids), -1))  # fmt: skip
    gate = logits[:, -1:].float().sigmoid() if routing.shared_gate else torch.ones(len(ids), 1)
    torch.testing.assert_close(weights[:, shared].cpu(), gate.expand(-1, routing.shared_experts), rtol=2e-3, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ROUTINGS)
def test_moe_route_matches_the_reference(name, dtype):
    experts, routing = ROUTINGS[name]
    generator = torch.Generator().manual_seed(experts)
    # distinct logits, exact in every dtype (multiples of 1/16 up to 8), so that no tie blurs the choice
    columns = router_columns(experts, routing)
    logits = torch.stack([torch.randperm(columns, generator=generator) - columns // 2 for _ in range(23)]) / 16
    bias = torch.randn(experts, generator=generator) * 0.05 if routing.correction_bias else None
    expected_weights, expected_ids = TorchOps().moe_route(logits, routing, bias)
    weights, ids = moe_routing.moe_route(logits.to(DEVICE, dtype), routing, None if bias is None else bias.to(DEVICE))
    assert weights.dtype == torch.float32 and ids.shape == (23, routing.top_k + routing.shared_experts)
    assert torch.equal(ids.cpu().long(), expected_ids)
    torch.testing.assert_close(weights.cpu(), expected_weights, rtol=1e-5, atol=1e-6)
    if routing.num_groups > 1:
        ungrouped = Routing(**{**routing.__dict__, "num_groups": 1, "topk_groups": 1})
        assert not torch.equal(TorchOps().moe_route(logits, ungrouped, bias)[1][:, : routing.top_k],
                               ids[:, : routing.top_k].cpu().long())  # fmt: skip
    if routing.shared_experts:
        assert_shared_experts_follow(weights, ids, experts, routing, logits)


@pytest.mark.parametrize("name", ROUTINGS)
def test_moe_route_names_an_expert_for_nan_and_infinite_logits(name):
    """A padded row of a captured step routes whatever its buffer holds; fused_moe then reads
    the weights of the ids it is given, so each must name an expert."""
    experts, routing = ROUTINGS[name]
    logits = torch.randn(4, router_columns(experts, routing), generator=torch.Generator().manual_seed(1))
    logits[0] = float("nan")
    logits[1, ::2] = float("nan")
    logits[2] = float("inf")
    logits[3] = -float("inf")
    bias = torch.zeros(experts, device=DEVICE) if routing.correction_bias else None
    _, ids = moe_routing.moe_route(logits.to(DEVICE), routing, bias)
    assert ((ids >= 0) & (ids < experts + routing.shared_experts)).all()


def test_moe_route_leaves_groups_not_in_a_power_of_two_to_the_reference():
    routing = Routing(top_k=2, scoring="sigmoid", correction_bias=True, num_groups=3, topk_groups=2)
    assert not moe_routing.covers(routing)
    logits, bias = torch.randn(5, 12, generator=torch.Generator().manual_seed(0)), torch.zeros(12)
    got = CudaOps().moe_route(logits.to(DEVICE), routing, bias.to(DEVICE))
    expected = TorchOps().moe_route(logits, routing, bias)
    assert all(torch.equal(g.cpu(), e) for g, e in zip(got, expected))


@pytest.mark.parametrize(
    "routing",
    [
        Routing(top_k=4, renormalize=True, per_expert_scale=True),
        Routing(top_k=4, scoring="sqrtsoftplus", renormalize=True, scaling_factor=1.5, fixed_table=True),
    ],
    ids=["per-expert-scale", "fixed-table"],
)
def test_router_routes_alike_on_both_backends(routing):
    """What the kernel leaves to the router (a per-expert scale, a fixed table) still applies."""
    router = Router(32, 16, 50, routing)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in router.parameters():
            if param.is_floating_point():
                param.copy_(torch.randn(param.shape, generator=generator))
        if routing.fixed_table:
            router.tid2eid.copy_(torch.randint(0, 16, router.tid2eid.shape, generator=generator))
    x, token_ids = torch.randn(9, 32, generator=generator), torch.randint(0, 50, (9,), generator=generator)
    with ops.use(TorchOps()), torch.no_grad():
        expected_weights, expected_ids = router(x, token_ids)
    with ops.use(CudaOps()), torch.no_grad():
        weights, ids = router.to(DEVICE)(x.to(DEVICE), token_ids.to(DEVICE))
    assert torch.equal(ids.cpu().long(), expected_ids)
    torch.testing.assert_close(weights.cpu(), expected_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("with_residual", [False, True], ids=["first-layer", "residual"])
@pytest.mark.parametrize("name", ROUTINGS)
def test_norm_route_matches_the_reference(name, with_residual):
    """The norm, the router's GEMV and the routing of one row in one launch (the last program
    routes): the experts, their weights, the normalized row and the new residual, in a few
    tiles; the launch leaves its counter at zero for the next layer."""
    experts, routing = ROUTINGS[name]
    generator = torch.Generator().manual_seed(experts + with_residual)
    hidden = 96

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    x, norm_weight = randn(1, hidden), randn(hidden)
    weight = randn(router_columns(experts, routing), hidden) * hidden**-0.5
    residual = randn(1, hidden) if with_residual else None
    bias = randn(experts) * 0.05 if routing.correction_bias else None
    expected = TorchOps().norm_route(x, residual, norm_weight, 1e-6, weight, routing, bias)
    on = [None if t is None else t.to(DEVICE) for t in (x, residual, norm_weight, weight, bias)]
    for tile in (ONE_ROW_TILES + ONE_PASS_TILES)[:: 1 if ON_GPU else 4]:
        weights, ids, normed, h = norm_linear.norm_route(*on[:3], 1e-6, on[3], routing, on[4], tile)
        assert torch.equal(ids.cpu().long(), expected[1]), tile
        torch.testing.assert_close(weights.cpu(), expected[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(normed.cpu(), expected[2], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(h.cpu(), expected[3], rtol=0, atol=0)
        assert int(arrivals.counters(DEVICE, "norm_route", 1).abs().sum()) == 0
    if routing.shared_experts:
        logits = TorchOps().norm_linear(x, residual, norm_weight, 1e-6, weight)[0]
        assert_shared_experts_follow(weights, ids, experts, routing, logits)


def test_norm_route_rounds_logits_to_the_router_dtype():
    """With a half-precision router the logits are rounded to it before the routing, as the
    separate ops' are: the weights equal the reference's from the same rounded logits."""
    experts, routing = ROUTINGS["qwen3"]
    generator = torch.Generator().manual_seed(3)
    x, residual = torch.randn(1, 64, generator=generator), torch.randn(1, 64, generator=generator)
    norm_weight, weight = torch.randn(64, generator=generator), torch.randn(experts, 64, generator=generator) / 8
    args = [t.to(DEVICE, torch.float16) for t in (x, residual, norm_weight)]
    weights, ids, normed, _ = norm_linear.norm_route(*args, 1e-6, weight.to(DEVICE, torch.float16), routing, None,
                                                      ONE_ROW_TILES[0])  # fmt: skip
    logits = (normed.cpu().float() @ weight.half().float().T).half()  # the kernel's own normed row
    expected_weights, expected_ids = TorchOps().moe_route(logits, routing, None)
    assert torch.equal(ids.cpu().long(), expected_ids)
    torch.testing.assert_close(weights.cpu(), expected_weights, rtol=2e-3, atol=1e-4)


def test_router_forward_norm_routes_alike_on_both_backends():
    """The MoE block's fused path (norm into the router, routing with it) gives the unfused
    block's experts and weights; on the CUDA backend through the measured choice."""
    router = Router(32, 16, None, Routing(top_k=4, renormalize=True, per_expert_scale=True))
    norm = RMSNorm(32)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in (*router.parameters(), norm.weight):
            param.copy_(torch.randn(param.shape, generator=generator))
    h, residual = torch.randn(1, 32, generator=generator), torch.randn(1, 32, generator=generator)
    with ops.use(TorchOps()), torch.no_grad():
        normed, new_residual = norm(h, residual)
        expected_weights, expected_ids = router(normed)
    times = iter([10.0] + [5.0] * len(ONE_ROW_TILES + ONE_PASS_TILES))  # on a GPU: the fused launch measured faster

    def timer(call, weights):
        call(weights[0])
        return next(times)

    backend = CudaOps()
    backend.small_batch_linear = SmallBatchLinear(timer, copies=lambda w: [w])
    with ops.use(backend), torch.no_grad():
        router.to(DEVICE), norm.to(DEVICE)
        weights, ids, x, residual_out = router.forward_norm(norm, h.to(DEVICE), residual.to(DEVICE))
    assert torch.equal(ids.cpu().long(), expected_ids)
    torch.testing.assert_close(weights.cpu(), expected_weights, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.cpu(), normed, rtol=1e-5, atol=1e-6)
    assert torch.equal(residual_out.cpu(), new_residual)


def test_small_batch_moe_takes_measured_tiles_only_where_clearly_faster(monkeypatch):
    """The heuristic's tiles are timed first, then each candidate, over routings to distinct
    random experts; a candidate replaces the heuristic only when clearly faster, and each
    (token count, shape) is measured once."""
    candidates = (SLOT_TILES["pipelined"], SLOT_TILES["split"])
    monkeypatch.setattr(moe, "slot_candidates", lambda tokens, top_k, x: candidates)
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(2, 32, generator=generator).to(DEVICE)
    w13 = (torch.randn(8, 64, 32, generator=generator) / 6).to(DEVICE)
    w2 = (torch.randn(8, 32, 32, generator=generator) / 6).to(DEVICE)
    for times, expected in (([10.0, 9.9, 9.8], None), ([10.0, 9.0, 8.0], SLOT_TILES["split"])):
        timed = iter(times)

        def timer(call, steps, timed=timed):
            step = steps[-1]
            assert all(len(set(ids.tolist())) == 3 for ids in step[2].cpu())  # distinct experts per token
            reference = TorchOps().fused_moe(*(t.cpu() for t in (step[0], w13, w2, step[1], step[2])), "silu")
            torch.testing.assert_close(call(step).cpu(), reference, rtol=TOL[torch.float32], atol=TOL[torch.float32])
            return next(timed)

        chooser = moe_tiles.SmallBatchMoE(timer, routings=2)
        for _ in range(2):  # (the second call is not timed: the timer would run out)
            assert chooser.tiles(x, w13, w2, 3, "silu") == (expected or moe.slot_tiles(2, 3, x))
        assert f"measured tiles for {int(expected is not None)}, the heuristic's for {int(expected is None)}" in (
            chooser.report() or ""
        )

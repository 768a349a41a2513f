"""The MoE block against transformers' own MoE modules (fp32, CPU), one routing each, and the
fused-MoE op's torch reference against a plain loop over tokens."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import DeepseekV4Config, Gemma4TextConfig, Glm4MoeConfig, MiniMaxM2Config, Qwen2MoeConfig
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter, DeepseekV4TopKRouter
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRouter
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE
from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2SparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

from xinfer import ops
from xinfer.layers.moe import MoE, Router, Routing
from xinfer.model import finish_loading
from xinfer.torch_ops import TorchOps

HIDDEN, EXPERTS, INTERMEDIATE, TOKENS = 32, 16, 24, 40


@pytest.fixture(autouse=True)
def torch_ops():
    with ops.use(TorchOps()), torch.no_grad():
        yield


def randomize(module: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter and buffer random, router weights large enough that tokens spread."""
    generator = torch.Generator().manual_seed(seed)
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.is_floating_point():
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * (0.5 if tensor.dim() > 1 else 0.1))


def load_hf_block(ours: MoE, hf: torch.nn.Module) -> None:
    """``hf``'s tensors into ``ours``: experts through their own loading, the shared MLP's
    gate and up merged, the rest by name."""
    params = dict(ours.named_parameters())
    tensors = hf.state_dict()
    for name, tensor in tensors.items():
        name = {"e_score_correction_bias": "gate.e_score_correction_bias"}.get(name, name)  # MiniMax-M2's place
        if name.startswith("experts."):
            ours.experts.load_checkpoint(name.removeprefix("experts."), tensor)
        elif ".gate_proj." in name:
            up = tensors[name.replace(".gate_proj.", ".up_proj.")]
            params[name.replace(".gate_proj.", ".gate_up_proj.")].copy_(torch.cat((tensor, up)))
        elif ".up_proj." not in name:
            params[name].copy_(tensor)


def spread(ids: torch.Tensor) -> int:
    return ids.unique().numel()


def hidden(seed: int = 1) -> torch.Tensor:
    return torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(seed))


def assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


SIZES = dict(hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE, hidden_act="silu")


def assert_runs_shared_as_routed(ours: MoE, x: torch.Tensor, expected: torch.Tensor, shared_experts: int) -> None:
    """After loading, the shared MLP runs as ``shared_experts`` more experts that every token takes, and the
    block's output stays ``expected``."""
    ours.finish_loading()
    assert ours.gate.routing.shared_experts == shared_experts
    assert ours.experts.w13.shape[0] == EXPERTS + shared_experts and ours.shared_expert_gate is None
    assert not hasattr(ours, ours.shared_name)
    assert (ours.gate(x)[1][:, -shared_experts:] == torch.arange(EXPERTS, EXPERTS + shared_experts)).all()
    assert_close(ours(x), expected)


@pytest.mark.parametrize("renormalize", [False, True])
def test_softmax_top_k_with_sigmoid_gated_shared_expert_matches_qwen2_moe(renormalize):
    config = Qwen2MoeConfig(**SIZES, num_experts=EXPERTS, num_experts_per_tok=4, norm_topk_prob=renormalize,
                            shared_expert_intermediate_size=48)  # fmt: skip
    hf = Qwen2MoeSparseMoeBlock(config).float()
    randomize(hf)
    ours = MoE(HIDDEN, EXPERTS, INTERMEDIATE, Routing(top_k=4, renormalize=renormalize),
               shared_intermediate_size=48, shared_expert_gate=True)  # fmt: skip
    load_hf_block(ours, hf)
    x = hidden()
    assert spread(ours.gate(x)[1]) >= EXPERTS // 2
    expected = hf(x.unsqueeze(0))[0]
    assert_close(ours(x), expected)
    assert_runs_shared_as_routed(ours, x, expected, shared_experts=2)


def test_the_devices_cache_is_released_after_each_block_lays_out_its_experts():
    blocks = [MoE(HIDDEN, EXPERTS, INTERMEDIATE, Routing(top_k=4), shared_intermediate_size=2 * INTERMEDIATE)
              for _ in range(3)]  # fmt: skip
    held_after_each = []
    finish_loading(nn.Sequential(*blocks), lambda: held_after_each.append(sum(b.experts.w13.shape[0] for b in blocks)))
    assert held_after_each == [EXPERTS * 3 + 2, EXPERTS * 3 + 4, EXPERTS * 3 + 6]


@pytest.mark.parametrize("bias, shared_size", [(False, 40), (True, 48)], ids=["rows-not-a-multiple", "biased"])
def test_shared_experts_that_cannot_run_as_routed_ones_stay_apart(bias, shared_size):
    ours = MoE(HIDDEN, EXPERTS, INTERMEDIATE, Routing(top_k=4), shared_intermediate_size=shared_size,
               shared_name="shared_experts", shared_bias=bias)  # fmt: skip
    randomize(ours)
    x = hidden()
    expected = ours(x)
    ours.finish_loading()
    assert ours.gate.routing.shared_experts == 0 and ours.experts.w13.shape[0] == EXPERTS
    assert_close(ours(x), expected)


def test_sigmoid_with_correction_bias_groups_and_scaling_matches_glm4_moe():
    config = Glm4MoeConfig(**SIZES, n_routed_experts=EXPERTS, num_experts_per_tok=4, n_group=4, topk_group=2,
                           routed_scaling_factor=2.5, norm_topk_prob=True, n_shared_experts=1)  # fmt: skip
    hf = Glm4MoeMoE(config).float()
    randomize(hf)
    routing = Routing(top_k=4, scoring="sigmoid", renormalize=True, correction_bias=True, num_groups=4,
                      topk_groups=2, scaling_factor=2.5, fp32_logits=True)  # fmt: skip
    ours = MoE(HIDDEN, EXPERTS, INTERMEDIATE, routing, shared_intermediate_size=INTERMEDIATE,
               shared_name="shared_experts")  # fmt: skip
    load_hf_block(ours, hf)
    x = hidden()
    _, ids = ours.gate(x)
    ungrouped = Router(HIDDEN, EXPERTS, None, Routing(**{**routing.__dict__, "num_groups": 1, "topk_groups": 1}))
    ungrouped.load_state_dict(ours.gate.state_dict())
    assert spread(ids) >= EXPERTS // 2
    assert (ids.sort().values != ungrouped(x)[1].sort().values).any(), "the group limit changes no token's choice"
    expected = hf(x.unsqueeze(0))[0]
    assert_close(ours(x), expected)
    assert_runs_shared_as_routed(ours, x, expected, shared_experts=1)


def test_sigmoid_with_correction_bias_matches_minimax_m2():
    config = MiniMaxM2Config(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_local_experts=EXPERTS,
                             num_experts_per_tok=3)  # fmt: skip
    hf = MiniMaxM2SparseMoeBlock(config).float()
    randomize(hf)
    ours = MoE(
        HIDDEN, EXPERTS, INTERMEDIATE, Routing(top_k=3, scoring="sigmoid", renormalize=True, correction_bias=True)
    )
    load_hf_block(ours, hf)
    x = hidden()
    assert spread(ours.gate(x)[1]) >= EXPERTS // 2
    assert_close(ours(x), hf(x.unsqueeze(0))[0])


def deepseek_v4_config() -> DeepseekV4Config:
    return DeepseekV4Config(hidden_size=HIDDEN, num_local_experts=EXPERTS, num_experts_per_tok=4, vocab_size=50,
                            routed_scaling_factor=1.5, scoring_func="sqrtsoftplus")  # fmt: skip


def test_sqrtsoftplus_with_correction_bias_and_scaling_matches_deepseek_v4():
    hf = DeepseekV4TopKRouter(deepseek_v4_config()).float()
    randomize(hf)
    ours = Router(HIDDEN, EXPERTS, None, Routing(top_k=4, scoring="sqrtsoftplus", renormalize=True,
                                                 correction_bias=True, scaling_factor=1.5))  # fmt: skip
    ours.load_state_dict(hf.state_dict(), strict=False)
    x = hidden()
    _, expected_weights, expected_ids = hf(x)
    weights, ids = ours(x)
    assert spread(ids) >= EXPERTS // 2
    order, expected_order = ids.argsort(), expected_ids.argsort()
    assert torch.equal(ids.gather(1, order), expected_ids.gather(1, expected_order))
    assert_close(weights.gather(1, order), expected_weights.gather(1, expected_order))


def test_fixed_token_to_expert_table_matches_deepseek_v4_hash_router():
    hf = DeepseekV4HashRouter(deepseek_v4_config()).float()
    randomize(hf)
    hf.tid2eid.copy_(torch.randint(0, EXPERTS, hf.tid2eid.shape, generator=torch.Generator().manual_seed(2)))
    routing = Routing(top_k=4, scoring="sqrtsoftplus", renormalize=True, scaling_factor=1.5, fixed_table=True)
    ours = Router(HIDDEN, EXPERTS, 50, routing)
    ours.load_state_dict(hf.state_dict())
    x, token_ids = hidden(), torch.randint(0, 50, (TOKENS,), generator=torch.Generator().manual_seed(3))
    _, expected_weights, expected_ids = hf(x, token_ids)
    weights, ids = ours(x, token_ids)
    assert torch.equal(ids, expected_ids)
    assert_close(weights, expected_weights)


def test_per_expert_scale_matches_gemma4_router():
    config = Gemma4TextConfig(hidden_size=HIDDEN, num_experts=EXPERTS, top_k_experts=4)
    hf = Gemma4TextRouter(config).float()
    randomize(hf)
    ours = Router(HIDDEN, EXPERTS, None, Routing(top_k=4, renormalize=True, per_expert_scale=True))
    ours.weight.copy_(hf.proj.weight)
    ours.per_expert_scale.copy_(hf.per_expert_scale)
    x = hidden()
    _, expected_weights, expected_ids = hf(x)
    # Gemma 4's router normalizes its own input; ours routes what it is given
    weights, ids = ours(hf.norm(x) * hf.scale * hf.scalar_root_size)
    assert spread(ids) >= EXPERTS // 2
    assert torch.equal(ids, expected_ids)
    assert_close(weights, expected_weights)


def test_dense_mlp_in_parallel_adds_its_output():
    routing = Routing(top_k=2)
    ours = MoE(HIDDEN, EXPERTS, INTERMEDIATE, routing, dense_intermediate_size=40)
    randomize(ours)
    x = hidden()
    weights, ids = ours.gate(x)
    experts = ops.fused_moe(x, ours.experts.w13, ours.experts.w2, weights, ids, "silu")
    assert_close(ours(x), experts + ours.dense_mlp(x))


def test_unknown_routing_function_is_named():
    with pytest.raises(ValueError, match="scoring_func 'entmax'"):
        Routing(top_k=2, scoring="entmax")


def loop_reference(x, w13, w2, topk_weights, topk_ids, act):
    """Every (token, chosen expert) pair on its own, in fp64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for weight, e in zip(topk_weights[t].tolist(), topk_ids[t].tolist()):
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            out[t] += weight * (w2[e].double() @ (act(gate) * up))
    return out


@pytest.mark.parametrize(
    "activation, act",
    [("silu", F.silu), ("gelu_pytorch_tanh", lambda g: F.gelu(g, approximate="tanh")), ("gelu", F.gelu),
     ("relu2", lambda g: F.relu(g) ** 2), ("tanh", torch.tanh)],  # (the last two: no backend fuses them)
)  # fmt: skip
def test_fused_moe_reference_sums_weighted_experts(activation, act):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(7, HIDDEN, generator=generator)
    w13 = torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=generator) * 0.2
    w2 = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=generator) * 0.2
    topk_ids = torch.stack([torch.randperm(EXPERTS, generator=generator)[:3] for _ in range(7)])
    topk_weights = torch.rand(7, 3, generator=generator)
    got = ops.fused_moe(x, w13, w2, topk_weights, topk_ids, activation)
    torch.testing.assert_close(
        got.double(), loop_reference(x, w13, w2, topk_weights, topk_ids, act), rtol=1e-5, atol=1e-5
    )

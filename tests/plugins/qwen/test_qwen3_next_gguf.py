"""GGUFs of architectures ``qwen3next``, ``qwen35`` and ``qwen35moe`` written here as llama.cpp's converter
(convert_hf_to_gguf.py, ``Qwen3NextModel`` and its Qwen3.5 subclasses) writes them — zero-centred norms + 1,
``-exp(A_log)``, ``dt_bias`` as ``ssm_dt.bias``, the conv squeezed, Qwen3-Next's ``in_proj_qkvz`` split in
``attn_qkv`` and ``attn_gate``, Qwen3.5's value heads tiled, experts stacked, an MTP layer counted in
``block_count`` — through the engine against transformers' modeling code of the model they came from."""

import json

import gguf
import pytest
import torch

from tests.llama_cpp_oracle import assert_llama_cpp_agrees
from tests.loading.gguf_models import reference_llm
from tests.plugins.converted_gguf import add_tiny_vocabulary, checkpoint_tensors, stacked_experts
from tests.plugins.hf_parity import assert_greedy_tokens_and_logprobs_match, assert_prefill_logits_match
from tests.plugins.qwen.test_qwen3_next import CONFIGS, randomize_hybrid, spread_routing
from tests.tiny_models import save_tiny_model
from xinfer import LLM
from xinfer.loading.gguf import load_gguf_config

ARCHS = {"qwen3-next": "qwen3next", "qwen3.5": "qwen35", "qwen3.5-moe": "qwen35moe"}
# llama.cpp's Gated DeltaNet has value heads as wide as key heads; its qwen3next has no dense MLP layers,
# and renormalizes the top-k weights
LLAMA_CPP_SETTINGS = {
    "qwen3-next": dict(linear_value_head_dim=16, mlp_only_layers=[], norm_topk_prob=True),
    "qwen3.5": dict(linear_value_head_dim=16),
    "qwen3.5-moe": dict(linear_value_head_dim=16),
}
# the converter's interleaved M-RoPE sections where the checkpoint names none (text: one position, plain rope)
MROPE_SECTIONS = [11, 11, 10, 0]
Q8_0 = gguf.GGMLQuantizationType.Q8_0
MTP_LAYERS = {"qwen3next": 0, "qwen35": 1, "qwen35moe": 1}  # the converter drops Qwen3-Next's


def tiled(rows: torch.Tensor, config, head_dim: int, dim: int = 0) -> torch.Tensor:
    """Value heads from grouped by key head [Hk, r] to tiled [r, Hk] along ``dim``."""
    group = config.linear_num_value_heads // config.linear_num_key_heads
    grouped = rows.unflatten(dim, (config.linear_num_key_heads, group, head_dim))
    return grouped.transpose(dim, dim + 1).flatten(dim, dim + 2)


def per_key_head(tensor: torch.Tensor, config, sizes: list[int]) -> list[torch.Tensor]:
    return [part.flatten(0, 1) for part in tensor.unflatten(0, (config.linear_num_key_heads, -1)).split(sizes, 1)]


def converted(name: str, tensor: torch.Tensor, config, arch: str) -> dict[str, torch.Tensor]:
    """What the converter writes (HF names, before gguf's table) for one HF tensor."""
    qk_rows, head_v_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim, config.linear_value_head_dim
    if arch != "qwen3next" and ".linear_attn." in name:
        module = name.split(".")[-2] if name.endswith(".weight") else name.split(".")[-1]
        if module in ("in_proj_qkv", "conv1d"):
            rows = tensor.squeeze(1)
            tensor = torch.cat([rows[:qk_rows], tiled(rows[qk_rows:], config, head_v_dim)])
        elif module == "in_proj_z":
            tensor = tiled(tensor, config, head_v_dim)
        elif module in ("in_proj_b", "in_proj_a", "A_log", "dt_bias"):
            tensor = tiled(tensor, config, 1)
        elif module == "out_proj":
            tensor = tiled(tensor, config, head_v_dim, dim=1)
    if name.endswith("A_log"):
        return {name: -tensor.exp()}
    if name.endswith("dt_bias"):
        return {name.replace("dt_bias", "dt_proj.bias"): tensor}
    if name.endswith("conv1d.weight"):
        return {name: tensor.squeeze(1)}
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return {name: tensor + 1}
    if name.endswith("in_proj_qkvz.weight"):
        group = config.linear_num_value_heads // config.linear_num_key_heads
        key, value = config.linear_key_head_dim, group * head_v_dim
        q, k, v, z = per_key_head(tensor, config, [key, key, value, value])
        return {name.replace("qkvz", "qkv"): torch.cat([q, k, v]), name.replace("qkvz", "z"): z}
    return {name: tensor}


def mtp_layer(tensors: dict[str, torch.Tensor], config, index: int) -> dict[str, torch.Tensor]:
    """An MTP layer as the converter appends it (block ``index``): a full-attention decoder block (here a copy of
    the first one's, under the file's names) and its next-token projection and norms."""
    full = f"blk.{config.layer_types.index('full_attention')}."
    block = {name.replace(full, f"blk.{index}.", 1): t for name, t in tensors.items() if name.startswith(full)}
    hidden = config.hidden_size
    return block | {
        f"blk.{index}.nextn.eh_proj.weight": torch.randn(hidden, 2 * hidden) / hidden,
        f"blk.{index}.nextn.enorm.weight": torch.ones(hidden),
        f"blk.{index}.nextn.hnorm.weight": torch.ones(hidden),
        f"blk.{index}.nextn.shared_head_norm.weight": torch.ones(hidden),
    }


def write_gguf(folder, config, arch: str, path, q8_0: tuple[str, ...] = ()) -> None:
    """``q8_0``: the tensors whose gguf name has one of these in it are written Q8_0 (the rest F32)."""
    writer = gguf.GGUFWriter(path, arch)
    block_count = config.num_hidden_layers + MTP_LAYERS[arch]
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(block_count)
    if arch == "qwen35":
        writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(int(config.head_dim * config.rope_parameters["partial_rotary_factor"]))
    if arch != "qwen3next":
        writer.add_rope_dimension_sections(MROPE_SECTIONS)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
    writer.add_ssm_state_size(config.linear_key_head_dim)
    writer.add_ssm_group_count(config.linear_num_key_heads)
    writer.add_ssm_time_step_rank(config.linear_num_value_heads)
    writer.add_ssm_inner_size(config.linear_value_head_dim * config.linear_num_value_heads)
    # the converter's per-layer recurrent flags (the MTP layers' false), and the interval config.json names: none
    # here (transformers keeps only layer_types), so llama.cpp's default 4, which the flags override
    recurrent = [kind == "linear_attention" for kind in config.layer_types] + [False] * MTP_LAYERS[arch]
    writer.add_array(f"{arch}.attention.recurrent_layers", recurrent)
    writer.add_full_attention_interval(
        json.loads((folder / "config.json").read_text()).get("full_attention_interval", 4)
    )
    if arch != "qwen35":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if MTP_LAYERS[arch]:
        writer.add_nextn_predict_layers(MTP_LAYERS[arch])
    add_tiny_vocabulary(writer, config.vocab_size)
    table = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), block_count)
    tensors = {}
    for name, tensor in stacked_experts(checkpoint_tensors(folder)).items():
        tensors |= converted(name, tensor, config, arch)
    gguf_tensors = {}
    for name, tensor in tensors.items():
        gguf_name = table.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"gguf's table has no {arch} name for {name}"
        gguf_tensors[gguf_name] = tensor
    for i in range(MTP_LAYERS[arch]):
        gguf_tensors |= mtp_layer(gguf_tensors, config, config.num_hidden_layers + i)
    for gguf_name, tensor in gguf_tensors.items():
        values = tensor.float().contiguous().numpy()
        if any(part in gguf_name for part in q8_0):
            writer.add_tensor(gguf_name, gguf.quants.quantize(values, Q8_0), raw_dtype=Q8_0)
        else:
            writer.add_tensor(gguf_name, values, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=sorted(ARCHS))
def models(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"{request.param}-gguf")
    config = CONFIGS[request.param]()
    for field, value in LLAMA_CPP_SETTINGS.get(request.param, {}).items():
        setattr(config, field, value)
    hf = save_tiny_model(config, folder)
    randomize_hybrid(hf)
    spread_routing(hf)
    hf.save_pretrained(folder, safe_serialization=True)
    path = folder / "tiny.gguf"
    write_gguf(folder, hf.config, ARCHS[request.param], path)
    return hf, LLM(model=str(path), dtype="float32", num_blocks=64, max_num_batched_tokens=16), path


def test_config_reads_the_hybrid_layers(models):
    hf, _, path = models
    config = load_gguf_config(path)
    assert config.architectures == hf.config.architectures
    assert config.layer_types == hf.config.layer_types
    for field in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                  "linear_conv_kernel_dim", "head_dim"):  # fmt: skip
        assert getattr(config, field) == getattr(hf.config, field), field
    assert config.rope_parameters["partial_rotary_factor"] == hf.config.rope_parameters["partial_rotary_factor"]


@pytest.mark.parametrize("length", (3, 61))
def test_prefill_logits_match_hf(models, length):
    hf, llm, _ = models
    assert_prefill_logits_match(hf, llm, length)


def test_greedy_tokens_and_logprobs_match_hf(models):
    hf, llm, _ = models
    assert_greedy_tokens_and_logprobs_match(hf, llm, 21)


def test_llama_cpp_reads_the_gguf_alike(models):
    _, llm, path = models
    assert_llama_cpp_agrees(llm, path)


def test_a_quantized_ssm_ba_is_split_packed(tmp_path):
    """Qwen3-Next's fused ``ssm_ba`` in a block format: split per key head into ``in_proj_b`` and
    ``in_proj_a`` as rows of the packed weight (its bytes were split as if they were values). Its values are
    Q8_0's already, so the file holds the checkpoint's exactly."""
    config = CONFIGS["qwen3-next"]()
    for field, value in LLAMA_CPP_SETTINGS["qwen3-next"].items():
        setattr(config, field, value)
    hf = save_tiny_model(config, tmp_path)
    randomize_hybrid(hf)
    spread_routing(hf)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("in_proj_ba.weight"):
                param.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(param.numpy(), Q8_0), Q8_0)))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    path = tmp_path / "tiny.gguf"
    write_gguf(tmp_path, hf.config, "qwen3next", path, q8_0=("ssm_ba",))
    assert_prefill_logits_match(hf, reference_llm(path, dtype="float32", num_blocks=64), 29)

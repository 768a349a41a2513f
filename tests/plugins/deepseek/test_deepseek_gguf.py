"""A GGUF of architecture ``deepseek2`` written here as llama.cpp's converter writes one (latent attention
as one KV head over the latent, the per-head sizes as ``*_length_mla``, experts stacked, the MTP layer left
out, ``kv_b_proj`` split per head into ``attn_k_b`` transposed and ``attn_v_b`` as newer files hold it, or
whole as older ones do), through the engine against transformers' modeling code of the model it came from."""

import gguf
import numpy as np
import pytest
import torch

from tests.llama_cpp_oracle import assert_llama_cpp_agrees
from tests.plugins.converted_gguf import add_tiny_vocabulary, checkpoint_tensors, stacked_experts
from tests.plugins.deepseek.configs import YARN, deepseek_v3_config
from tests.plugins.deepseek.test_deepseek import save_with_mtp_layer
from tests.plugins.hf_parity import (
    assert_greedy_tokens_and_logprobs_match,
    assert_prefill_logits_match,
    randomize,
    spread_routing,
)
from tests.tiny_models import save_tiny_model
from xinfer import LLM
from xinfer.loading.gguf import load_gguf_config


def split_up_projections(tensors: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Each ``kv_b_proj`` as the converter splits it: ``k_b_proj`` [H, R, N] and ``v_b_proj`` [H, V, R]."""
    out = {}
    for name, tensor in tensors.items():
        if name.endswith("kv_b_proj.weight"):
            heads = tensor.view(config.num_attention_heads, -1, config.kv_lora_rank)
            k_b, v_b = heads.split([config.qk_nope_head_dim, config.v_head_dim], dim=1)
            out[name.replace("kv_b_proj", "k_b_proj")] = k_b.transpose(1, 2).contiguous()
            out[name.replace("kv_b_proj", "v_b_proj")] = v_b.contiguous()
        else:
            out[name] = tensor
    return out


def write_deepseek2_gguf(
    folder, config, path, split: bool, gating=gguf.ExpertGatingFuncType.SIGMOID, arch: str = "deepseek2",
    names_as: gguf.MODEL_ARCH = gguf.MODEL_ARCH.DEEPSEEK2, add_metadata=None, mtp: bool = False,
    left_out: tuple[str, ...] = (),
) -> None:  # fmt: skip
    """``arch``, ``names_as`` (the table naming the tensors), ``add_metadata(writer)``: an architecture that
    llama.cpp's converter writes as ``deepseek2`` plus its own keys and tensors. ``mtp``: the checkpoint's MTP
    layer kept, as the converter keeps GLM-4.7-Flash's; ``left_out``: the MoE keys the converter writes only
    where the checkpoint's config has the field."""
    rope = config.rope_parameters
    blocks = config.num_hidden_layers + mtp
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(blocks)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(1)
    writer.add_key_length(config.kv_lora_rank + config.qk_rope_head_dim)
    writer.add_value_length(config.kv_lora_rank)
    writer.add_key_length_mla(config.qk_nope_head_dim + config.qk_rope_head_dim)
    writer.add_value_length_mla(config.v_head_dim)
    if config.q_lora_rank is not None:
        writer.add_q_lora_rank(config.q_lora_rank)
    writer.add_kv_lora_rank(config.kv_lora_rank)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_dimension_count(config.qk_rope_head_dim)
    if rope["rope_type"] == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if "mscale_all_dim" in rope:  # as the converter: only where the checkpoint has one
            writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if "leading_dense_block_count" not in left_out:
        writer.add_leading_dense_block_count(config.first_k_dense_replace)
    writer.add_expert_count(config.n_routed_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_expert_group_count(config.n_group)
    writer.add_expert_group_used_count(config.topk_group)
    if "expert_weights_scale" not in left_out:
        writer.add_expert_weights_scale(config.routed_scaling_factor)
    if mtp:  # (llama.cpp loads the MTP layer's norms, which DeepSeek's checkpoint names as the converter maps)
        writer.add_nextn_predict_layers(1)
        for norm in ("enorm", "hnorm", "shared_head_norm"):
            writer.add_tensor(
                f"blk.{config.num_hidden_layers}.nextn.{norm}.weight", np.ones(config.hidden_size, np.float32)
            )
    if config.norm_topk_prob:
        writer.add_expert_weights_norm(True)
    writer.add_expert_gating_func(gating)
    if add_metadata is not None:
        add_metadata(writer)
    add_tiny_vocabulary(writer, config.vocab_size)
    names = gguf.get_tensor_name_map(names_as, blocks)
    tensors = {n: t for n, t in checkpoint_tensors(folder).items() if not n.startswith(f"model.layers.{blocks}.")}
    tensors = stacked_experts(split_up_projections(tensors, config) if split else tensors)
    for name, tensor in tensors.items():
        base, _, suffix = name.replace("e_score_correction_bias", "e_score_correction.bias").rpartition(".")
        gguf_name = names.get_name(base) or base.replace("model.layers.", "blk.").replace("eh_proj", "nextn.eh_proj")
        writer.add_tensor(f"{gguf_name}.{suffix}", tensor.float().numpy(), raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# the file keeps mscale_all_dim only: DeepSeek's mscale equals it
YARN_AS_DEEPSEEK = dict(YARN, mscale=0.8)
CASES = {
    "split kv_b, q-lora, yarn": (dict(rope_parameters=YARN_AS_DEEPSEEK), True),
    "whole kv_b, no q-lora": (dict(q_lora_rank=None), False),
}
# what llama.cpp (0.3.36's build) cannot load: whole attn_kv_b (it asks for attn_k_b), and no q_lora_rank below
# DeepSeek-V2-Lite's 26/27 layers (test_llama_cpp_reads_a_gguf_without_q_lora_alike has 26)
LLAMA_CPP_LOADS = {"split kv_b, q-lora, yarn"}


@pytest.fixture(scope="module", params=list(CASES))
def models(request, tmp_path_factory):
    overrides, split = CASES[request.param]
    folder = tmp_path_factory.mktemp("deepseek2-gguf")
    hf = save_tiny_model(deepseek_v3_config(**overrides), folder)
    randomize(hf)
    spread_routing(hf)
    save_with_mtp_layer(hf, folder)
    path = folder / "tiny.gguf"
    write_deepseek2_gguf(folder, hf.config, path, split)
    return hf, LLM(model=str(path), dtype="float32", num_blocks=64), path, request.param


def test_config_reads_the_latent_shape_and_routing(models):
    hf, _, path, _ = models
    config = load_gguf_config(path)
    assert config.architectures == ["DeepseekV3ForCausalLM"]
    for field in ("num_hidden_layers", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                  "v_head_dim", "first_k_dense_replace", "n_routed_experts", "n_shared_experts", "n_group",
                  "topk_group", "moe_intermediate_size", "routed_scaling_factor", "norm_topk_prob"):  # fmt: skip
        assert getattr(config, field) == getattr(hf.config, field), field


@pytest.mark.parametrize("length", (3, 40))
def test_prefill_logits_match_hf(models, length):
    hf, llm, _, _ = models
    assert_prefill_logits_match(hf, llm, length)


def test_greedy_tokens_and_logprobs_match_hf(models):
    hf, llm, _, _ = models
    assert_greedy_tokens_and_logprobs_match(hf, llm, 17)


def test_llama_cpp_reads_the_gguf_alike(models):
    _, llm, path, case = models
    if case not in LLAMA_CPP_LOADS:
        pytest.skip(f"llama.cpp loads no file like this one ({case}): whole attn_kv_b, no q_lora_rank at 3 layers")
    assert_llama_cpp_agrees(llm, path)


def assert_llama_cpp_agrees_on(config, tmp_path):
    """A tiny model of ``config`` with random weights and spread routing, as a split-kv GGUF: xinfer against
    llama.cpp only."""
    hf = save_tiny_model(config, tmp_path)
    randomize(hf)
    spread_routing(hf)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    write_deepseek2_gguf(tmp_path, hf.config, tmp_path / "tiny.gguf", split=True)
    assert_llama_cpp_agrees(
        LLM(model=str(tmp_path / "tiny.gguf"), dtype="float32", num_blocks=64), tmp_path / "tiny.gguf"
    )


def test_a_file_with_its_mtp_layer_and_without_the_optional_moe_keys_reads_as_llama_cpp(tmp_path):
    """GLM-4.7-Flash's file keeps its MTP layer (``block_count`` counts it, ``nextn_predict_layers`` says so),
    skipped; a checkpoint without a routed scaling or dense layers gets no ``expert_weights_scale`` or
    ``leading_dense_block_count``, which llama.cpp reads as 1 and 0 (transformers' defaults: 2.5 and 3)."""
    hf = save_tiny_model(deepseek_v3_config(routed_scaling_factor=1.0, first_k_dense_replace=0), tmp_path)
    randomize(hf)
    spread_routing(hf)
    save_with_mtp_layer(hf, tmp_path)
    path = tmp_path / "tiny.gguf"
    write_deepseek2_gguf(tmp_path, hf.config, path, split=True, mtp=True,
                         left_out=("leading_dense_block_count", "expert_weights_scale"))  # fmt: skip
    llm = LLM(model=str(path), dtype="float32", num_blocks=64)
    assert_prefill_logits_match(hf, llm, 29)
    assert_llama_cpp_agrees(llm, path)


def test_llama_cpp_reads_a_gguf_without_q_lora_alike(tmp_path):
    """No q-LoRA (a plain ``attn_q``): llama.cpp reads it only at DeepSeek-V2-Lite's 26 or 27 layers, so 26 here,
    against llama.cpp only."""
    assert_llama_cpp_agrees_on(deepseek_v3_config(q_lora_rank=None, num_hidden_layers=26), tmp_path)


def test_llama_cpp_reads_a_yarn_gguf_without_mscale_alike(tmp_path):
    """YaRN without mscale_all_dim (no yarn_log_multiplier in the file): llama.cpp scales the rotary part of q
    and of k by YaRN's usual 1 + 0.1 ln(factor), and the scores by its square (not what transformers does with
    the checkpoint), against llama.cpp only."""
    yarn = {key: value for key, value in YARN.items() if key not in ("mscale", "mscale_all_dim")}
    assert_llama_cpp_agrees_on(deepseek_v3_config(rope_parameters=yarn), tmp_path)


def test_llama_cpp_normalizes_the_latents_with_the_files_epsilon(tmp_path):
    """llama.cpp normalizes q's and kv's latents with rms_norm_eps, as every other norm (transformers keeps
    1e-6 for them): the two part at a larger epsilon (GLM-4.7-Flash's is 1e-5), against llama.cpp only."""
    assert_llama_cpp_agrees_on(deepseek_v3_config(rms_norm_eps=1e-2), tmp_path)


def test_softmax_gating_is_one_clear_error(tmp_path):
    hf = save_tiny_model(deepseek_v3_config(), tmp_path)
    write_deepseek2_gguf(tmp_path, hf.config, tmp_path / "v2.gguf", True, gguf.ExpertGatingFuncType.SOFTMAX)
    with pytest.raises(
        ValueError, match=r"deepseek2.expert_gating_func: deepseek2 GGUF with softmax expert gating .* is not supported"
    ):
        load_gguf_config(tmp_path / "v2.gguf")

"""Real models' shapes, for benchmarks on dummy weights (no checkpoint needed)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    DeepseekV3Config,
    DeepseekV4Config,
    Gemma3Config,
    Glm4MoeConfig,
    LlamaConfig,
    PretrainedConfig,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3VLConfig,
)

SHAPES = {
    "smollm2-135m": lambda: LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"],
    ),
    "qwen3-0.6b": lambda: Qwen3Config(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        architectures=["Qwen3ForCausalLM"],
    ),
    "qwen3-30b-a3b": lambda: Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        architectures=["Qwen3MoeForCausalLM"],
    ),
    # GLM-4.5-Air's layers (zai-org/GLM-4.5-Air config.json: a dense first layer, then 128 experts of which 8 and
    # one shared expert see each token; biases on q, k and v; rotary over half of each head) but 23 of its 46
    # layers: 106.0 GB of bf16 weights (2 x 1.24 GB embedding and LM head, 0.49 GB the dense layer, 4.68 GB each
    # MoE layer), the most that stays within ~110 GB on one H200 (141 GB), leaving the rest for the KV cache.
    "glm-4.5-air": lambda: Glm4MoeConfig(
        vocab_size=151552,
        hidden_size=4096,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=23,
        num_attention_heads=96,
        num_key_value_heads=8,
        head_dim=128,
        attention_bias=True,
        use_qk_norm=False,
        first_k_dense_replace=1,
        n_routed_experts=128,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        num_nextn_predict_layers=1,
        max_position_embeddings=131072,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0, partial_rotary_factor=0.5),
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        architectures=["Glm4MoeForCausalLM"],
    ),
    # GLM-4.5's architecture at toy sizes (q/k norms on, grouped routing, a scaled sum): moe.py --smoke on the CPU
    "glm4-moe-tiny": lambda: Glm4MoeConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attention_bias=True,
        use_qk_norm=True,
        first_k_dense_replace=1,
        n_routed_experts=16,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        max_position_embeddings=512,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
        tie_word_embeddings=False,
        architectures=["Glm4MoeForCausalLM"],
    ),
    # moonshotai/Moonlight-16B-A3B's config.json (DeepSeek-V3's architecture at DeepSeek-V2-Lite's size): 27 layers
    # of multi-head latent attention without q-LoRA (16 heads, latent 512 + rope key 64), a dense first layer,
    # then 64 experts of which 6 and 2 shared experts see each token: 16.0 B parameters, 2.9 B read per decoded token
    "moonlight-16b-a3b": lambda: DeepseekV3Config(
        vocab_size=163840,
        hidden_size=2048,
        intermediate_size=11264,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        first_k_dense_replace=1,
        n_routed_experts=64,
        n_shared_experts=2,
        num_experts_per_tok=6,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.446,
        max_position_embeddings=8192,
        rope_parameters=dict(rope_type="default", rope_theta=50000.0),
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        architectures=["DeepseekV3ForCausalLM"],
    ),
    # DeepSeek-V3's architecture at toy sizes (q-LoRA, grouped routing): mla.py --smoke on the CPU
    "deepseek-v3-tiny": lambda: DeepseekV3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        first_k_dense_replace=1,
        n_routed_experts=16,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        max_position_embeddings=512,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        tie_word_embeddings=False,
        architectures=["DeepseekV3ForCausalLM"],
    ),
    # DeepSeek-V4-Flash's layers (transformers' DeepseekV4Config defaults, which name deepseek-ai/DeepSeek-V4-Flash-Base:
    # h 4096, 64 query heads of 512 dims sharing one key-value head, 64 of them rotated; q-LoRA 1024; output in 8
    # groups of rank 1024; a window of 128 in every layer; CSA an entry per 4 tokens, its indexer 64 heads of 128
    # keeping 512, HCA an entry per 128; 4 hyper-connected streams; 256 experts of 2048, 6 and a shared one per
    # token, the first 3 layers hash-routed) but 8 of its 43 layers, in transformers' default schedule for 8
    # (HCA, HCA, then HCA and CSA alternating): 13.2 GB of bf16 weights per layer (the experts 12.9), 108 GB in
    # all with the 2 x 1.06 GB embedding and LM head, within one H200 beside the cache. A 128k context (the
    # compressed rope's YaRN factor 16 over 8k), not the checkpoint's million: the numbers it computes do not
    # change its speed.
    "deepseek-v4-flash-8l": lambda: DeepseekV4Config(
        num_hidden_layers=8,
        max_position_embeddings=131072,
        rope_parameters=dict(rope_type="yarn", factor=16.0, original_max_position_embeddings=8192),
        architectures=["DeepseekV4ForCausalLM"],
    ),
    # DeepSeek V4's architecture at toy sizes (every layer type): deepseek_v4.py --smoke on the CPU
    "deepseek-v4-tiny": lambda: DeepseekV4Config(
        vocab_size=512,
        hidden_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        head_dim=32,
        q_lora_rank=24,
        partial_rotary_factor=0.25,
        n_routed_experts=8,
        num_experts_per_tok=2,
        layer_types=[
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
        ],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        sliding_window=8,
        hc_mult=2,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=4,
        index_head_dim=16,
        index_topk=4,
        max_position_embeddings=512,
        architectures=["DeepseekV4ForCausalLM"],
    ),
    # Qwen3.6's hybrids (3 Gated DeltaNet layers to 1 of gated full attention), the text part of their HF configs
    # (Qwen/Qwen3.6-35B-A3B and Qwen/Qwen3.6-27B config.json's text_config, as Qwen3.5-35B-A3B's and -27B's; no hub
    # here). The 35B-A3B's agree with transformers' Qwen3_5MoeTextConfig defaults, which name Qwen3.5-35B-A3B. The
    # 27B's (transformers' Qwen3_5TextConfig defaults, though they name Qwen3.5-27B, are a smaller model: hidden
    # 4096, 32 layers) were checked against third-party copies of the real text_config: a Qwen3_5Config of the 27B
    # written out field by field in a public repository, slime's scripts/models/qwen3.5-27B.sh, and the model cards of
    # Qwen3.6-27B conversions (64 layers, hidden 5120, MLP 17408, 24 query / 4 KV heads of 256, 48 value / 16 key
    # heads of 128, conv 4, vocab 248320 untied, rope theta 1e7 on a quarter of the dims). All agree with the shape
    # below, which counts 26.90 B parameters: with the 27 ViT layers (about 0.46 B, by our count) and the MTP layer
    # (about 0.42 B) the checkpoint holds, 27.8 B, the 55.56 GB a write-up reads in its safetensors index. The real
    # rope is mRoPE (sections [11, 11, 10], interleaved), which equals this 1-D rope for text, whose three position
    # ids are the same.
    "qwen3.6-35b-a3b": lambda: Qwen3_5MoeTextConfig(
        vocab_size=248320,
        hidden_size=2048,
        num_hidden_layers=40,
        full_attention_interval=4,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        max_position_embeddings=262144,
        rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25),
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        architectures=["Qwen3_5MoeForCausalLM"],
    ),
    "qwen3.6-27b": lambda: Qwen3_5TextConfig(
        vocab_size=248320,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
        full_attention_interval=4,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        max_position_embeddings=262144,
        rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25),
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        architectures=["Qwen3_5ForCausalLM"],
    ),
    # Qwen3.6-35B-A3B's architecture at toy sizes (two value heads per key head): hybrid.py --smoke on the CPU
    "qwen3.6-moe-tiny": lambda: Qwen3_5MoeTextConfig(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=4,
        full_attention_interval=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        max_position_embeddings=512,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
        tie_word_embeddings=False,
        architectures=["Qwen3_5MoeForCausalLM"],
    ),
    # Qwen3.5's hybrid architecture at toy sizes (Gated DeltaNet, full attention, Gated DeltaNet): prefix_hits.py --smoke
    "qwen3.5-tiny": lambda: Qwen3_5TextConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        max_position_embeddings=4096,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
        tie_word_embeddings=False,
        architectures=["Qwen3_5ForCausalLM"],
    ),
    # Qwen/Qwen3-VL-8B-Instruct config.json: Qwen3-8B's text model with interleaved M-RoPE, a 27-block ViT
    # (patch 16, 2x2 merge) with DeepStack from blocks 8, 16 and 24
    "qwen3-vl-8b": lambda: qwen3_vl_config(
        text=dict(
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=262144,
            rope_parameters=dict(
                rope_type="default", rope_theta=5000000.0, mrope_section=[24, 20, 20], mrope_interleaved=True
            ),
        ),
        vision=dict(
            depth=27,
            hidden_size=1152,
            intermediate_size=4304,
            num_heads=16,
            out_hidden_size=4096,
            patch_size=16,
            num_position_embeddings=2304,
            deepstack_visual_indexes=[8, 16, 24],
        ),
        tokens=dict(
            image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653
        ),
    ),
    # Qwen3-VL at toy sizes: vision.py --smoke
    "qwen3-vl-tiny": lambda: qwen3_vl_config(
        text=dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=4096,
            rope_parameters=dict(
                rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3], mrope_interleaved=True
            ),
        ),
        vision=dict(
            depth=3,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            patch_size=16,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0, 2],
        ),
        tokens=dict(image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503),
    ),
    "llama-3.1-8b": lambda: LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rope_parameters=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
            rope_theta=500000.0,
        ),
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    ),
}


def qwen3_vl_config(text: dict, vision: dict, tokens: dict) -> Qwen3VLConfig:
    return Qwen3VLConfig(text_config={**text, "tie_word_embeddings": False}, vision_config=vision, **tokens,
                         tie_word_embeddings=False, architectures=["Qwen3VLForConditionalGeneration"])  # fmt: skip


def gemma3_4b_vision() -> Gemma3Config:
    """Gemma-3-4b-it: a 34-layer text model (5 sliding layers per global one) and SigLIP so400m."""
    layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(34)]
    text = dict(
        vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, sliding_window=1024, layer_types=layer_types,
        max_position_embeddings=131072, final_logit_softcapping=None,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    )  # fmt: skip
    vision = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                  image_size=896, patch_size=14, vision_use_head=False)  # fmt: skip
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=256, boi_token_index=255999,
                        eoi_token_index=256000, image_token_index=262144,
                        architectures=["Gemma3ForConditionalGeneration"])  # fmt: skip


SHAPES["gemma3-4b-vision"] = gemma3_4b_vision


def shape_folder(name: str, tokenizer: bool = False) -> str:
    """A folder holding the config.json of shape ``name`` (load with load_format="dummy"),
    and with ``tokenizer`` a synthetic tokenizer of the same vocabulary size."""
    config: PretrainedConfig = SHAPES[name]()
    folder = tempfile.mkdtemp(prefix=f"xinfer-{name}-")
    config.save_pretrained(folder)
    if tokenizer:
        save_synthetic_tokenizer(folder, config.get_text_config().vocab_size)
    return folder


def synthetic_tokenizer(vocab_size: int) -> Tokenizer:
    """Id ``i`` is the word ``t<i>``: every id decodes to its own non-empty text, so a
    server streams one chunk per generated token, whatever random weights produce.
    No id is special (a skipped special token would stream nothing)."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # decoding joins words with spaces
    return backend


def save_synthetic_tokenizer(folder: str | Path, vocab_size: int) -> None:
    """tokenizer.json and tokenizer_config.json of :func:`synthetic_tokenizer` in ``folder``."""
    folder = Path(folder)
    synthetic_tokenizer(vocab_size).save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0", "add_bos_token": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def has_qk_norm(config: PretrainedConfig) -> bool:
    """Per-head q/k norms: Qwen3's always, GLM-4.5's where ``use_qk_norm``."""
    return getattr(config, "use_qk_norm", config.model_type in ("qwen3", "qwen3_moe"))


def weight_bytes(config: PretrainedConfig, itemsize: int) -> int:
    """Bytes of weights a decode step reads (embedding rows are gathered, not read whole)."""
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    attn = h * d * (config.num_attention_heads * 2 + config.num_key_value_heads * 2)
    mlp = 3 * h * i
    norms = 2 * h + (2 * d if has_qk_norm(config) else 0)
    return itemsize * (layers * (attn + mlp + norms) + h + config.vocab_size * h)

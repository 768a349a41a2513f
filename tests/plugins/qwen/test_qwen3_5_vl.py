"""Qwen3.5 / Qwen3.6 image-text checkpoints (hybrid text model, vision encoder without DeepStack,
partial M-RoPE) through the engine against transformers' Qwen3_5ForConditionalGeneration and
Qwen3_5MoeForConditionalGeneration (tiny random configs, fp32, CPU, synthetic images)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
)

from tests.plugins.hf_parity import assert_output_matches_hf, spread_routing
from tests.plugins.qwen.test_qwen3_next import EXPERTS, HYBRID, randomize_hybrid
from tests.plugins.qwen.vl_fixtures import (
    GREEDY,
    IMAGE,
    VISION_END,
    VISION_START,
    assert_matches_hf,
    save_randomized,
    synthetic_image,
    text,
    tiny_vision_config,
    with_images,
)
from xinfer import LLM

TOKENS = dict(image_token_id=IMAGE, video_token_id=IMAGE + 1, vision_start_token_id=VISION_START,
              vision_end_token_id=VISION_END)  # fmt: skip
ROPE = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25, mrope_section=[2, 1, 1],
            mrope_interleaved=True)  # fmt: skip
VISION = {k: v for k, v in tiny_vision_config(out_hidden_size=HYBRID["hidden_size"]).to_dict().items()
          if k not in ("deepstack_visual_indexes", "model_type")}  # fmt: skip
CONFIGS = {
    "qwen3.5": lambda: (
        Qwen3_5ForConditionalGeneration,
        Qwen3_5Config(text_config={**HYBRID, "rope_parameters": ROPE, "model_type": "qwen3_5_text"},
                      vision_config=VISION, architectures=["Qwen3_5ForConditionalGeneration"], **TOKENS),
    ),
    "qwen3.5-moe": lambda: (
        Qwen3_5MoeForConditionalGeneration,
        Qwen3_5MoeConfig(text_config={**{k: v for k, v in HYBRID.items() if k != "intermediate_size"}, **EXPERTS,
                                      "rope_parameters": ROPE, "model_type": "qwen3_5_moe_text"},
                         vision_config=VISION, architectures=["Qwen3_5MoeForConditionalGeneration"], **TOKENS),
    ),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(CONFIGS))
def models(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    cls, config = CONFIGS[request.param]()
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = cls(config).float().eval()
    randomize_hybrid(hf)
    spread_routing(hf)
    save_randomized(hf, folder)
    return hf, LLM(model=str(folder), dtype="float32", num_blocks=64)


def test_image_prompt_matches_transformers(models):
    hf, llm = models
    assert_matches_hf(hf, llm, with_images(text(5, 1), "image", text(6, 2)), [synthetic_image(40, 24)])


def test_text_alone_matches_transformers(models):
    hf, llm = models
    tokens = text(21, 3)
    assert_output_matches_hf(hf, tokens, llm.generate([tokens], GREEDY)[0].outputs[0], GREEDY.max_tokens)

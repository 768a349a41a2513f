"""Qwen-VL vision config fields one at a time against transformers (found by a one-field sweep): values
transformers serves are served as it serves them; values it builds but cannot run an image through are
refused at load in one line naming the field."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from tests.plugins.qwen.test_qwen3_next import HYBRID, randomize_hybrid
from tests.plugins.qwen.vl_fixtures import (
    IMAGE,
    PREPROCESSOR,
    VIDEO,
    VISION_END,
    VISION_START,
    assert_matches_hf,
    save_randomized,
    synthetic_image,
    text,
    tiny_vl_config,
    with_images,
)
from xinfer import LLM

TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START,
              vision_end_token_id=VISION_END)  # fmt: skip
PROMPT = with_images(text(4, 1), "image", text(3, 2), "image", text(2, 3))
IMAGES = [synthetic_image(37, 23, seed=1), synthetic_image(90, 12, seed=2)]  # odd sides; a wide one


def qwen3_vl(**vision) -> tuple[type, Qwen3VLConfig]:
    base = tiny_vl_config()
    config = Qwen3VLConfig(text_config=base.text_config.to_dict(),
                           vision_config={**base.vision_config.to_dict(), **vision}, **TOKENS,
                           architectures=["Qwen3VLForConditionalGeneration"])  # fmt: skip
    return Qwen3VLForConditionalGeneration, config


def qwen3_5(**vision) -> tuple[type, Qwen3_5Config]:
    rope = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25, mrope_section=[2, 1, 1],
                mrope_interleaved=True)  # fmt: skip
    base_vision = {k: v for k, v in tiny_vl_config().vision_config.to_dict().items() if k != "deepstack_visual_indexes"}
    config = Qwen3_5Config(text_config={**HYBRID, "rope_parameters": rope, "model_type": "qwen3_5_text"},
                           vision_config={**base_vision, "out_hidden_size": HYBRID["hidden_size"], **vision},
                           architectures=["Qwen3_5ForConditionalGeneration"], **TOKENS)  # fmt: skip
    return Qwen3_5ForConditionalGeneration, config


def built(model, folder) -> torch.nn.Module:
    cls, config = model
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = cls(config).float().eval()
    randomize_hybrid(hf)
    save_randomized(hf, folder)
    return hf


SERVED = {
    # DeepStack index 2 past the last of 2 blocks: transformers takes block 0's features alone (xinfer split
    # the encoder's output into 3 levels of 2 and failed on the image)
    "depth below a deepstack index": lambda: qwen3_vl(depth=2),
    "deepstack index past every block": lambda: qwen3_vl(deepstack_visual_indexes=[5]),
    # Qwen3.5's encoder has no DeepStack: transformers ignores the field (xinfer wanted merger weights for it)
    "qwen3.5 ignores deepstack_visual_indexes": lambda: qwen3_5(deepstack_visual_indexes=[0, 2]),
    "deepstack indexes out of order": lambda: qwen3_vl(deepstack_visual_indexes=[2, 0]),
    "no deepstack": lambda: qwen3_vl(deepstack_visual_indexes=[]),
}


@pytest.mark.parametrize("name", list(SERVED))
def test_a_vision_field_transformers_serves_matches_it(name, tmp_path):
    hf = built(SERVED[name](), tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", num_blocks=64)
    assert_matches_hf(hf, llm, PROMPT, IMAGES)


def hf_inputs(config, preprocessor) -> dict:
    inputs = Qwen2VLImageProcessorPil(**preprocessor)(IMAGES, return_tensors="pt")
    tokens = (inputs["image_grid_thw"].prod(-1) // config.vision_config.spatial_merge_size**2).tolist()
    ids = text(3, 4) + [IMAGE] * tokens[0] + text(2, 5) + [IMAGE] * tokens[1]
    type_ids = (torch.tensor([ids]) == IMAGE).int()
    return dict(input_ids=torch.tensor([ids]), pixel_values=inputs["pixel_values"],
                image_grid_thw=inputs["image_grid_thw"], mm_token_type_ids=type_ids)  # fmt: skip


UNRUNNABLE = {
    "vision heads that do not divide its width": (
        lambda: qwen3_vl(num_heads=3),
        {},
        "vision_config hidden_size 32 is not a multiple of num_heads 3",
    ),
    "a vision head dim not a multiple of 4": (
        lambda: qwen3_5(hidden_size=36),
        {},
        r"vision_config head dim 18 \(hidden_size / num_heads\) is not a multiple of 4",
    ),
    "a vision head_dim other than its width per head": (
        lambda: qwen3_vl(head_dim=8),
        {},
        r"vision_config head_dim 8 is not hidden_size / num_heads \(16\)",
    ),
    "gray-scale patches": (lambda: qwen3_vl(in_channels=1), {}, "vision_config in_channels 1 is not supported"),
    "four-channel patches": (lambda: qwen3_5(in_channels=4), {}, "vision_config in_channels 4 is not supported"),
    "image embeddings narrower than the text model": (
        lambda: qwen3_vl(out_hidden_size=48),
        {},
        "vision_config out_hidden_size 48 is not the text model's hidden_size 64",
    ),
    "the image processor's merge size not the encoder's": (
        lambda: qwen3_vl(),
        {"merge_size": 1},
        "image processor merge_size 1 is not the vision config's spatial_merge_size 2",
    ),
    "the image processor's patch size not the encoder's": (
        lambda: qwen3_5(),
        {"patch_size": 8},
        "image processor patch_size 8 is not the vision config's patch_size 4",
    ),
}


@pytest.mark.parametrize("name", list(UNRUNNABLE))
def test_a_vision_field_transformers_cannot_run_an_image_through_is_refused_in_one_line(name, tmp_path):
    model, preprocessor_fields, message = UNRUNNABLE[name]
    hf = built(model(), tmp_path)
    preprocessor = {**PREPROCESSOR, **preprocessor_fields}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    with pytest.raises((RuntimeError, ValueError)), torch.inference_mode():
        hf(**hf_inputs(hf.config, preprocessor))
    with pytest.raises(ValueError, match=message) as refused:
        LLM(model=str(tmp_path), dtype="float32", num_blocks=64)
    assert "\n" not in str(refused.value)

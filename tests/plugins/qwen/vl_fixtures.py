"""Shared pieces of the Qwen-VL tests: synthetic images and tiny configs."""

from __future__ import annotations

import json

import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from tests.plugins.hf_parity import assert_output_matches_hf, randomize
from xinfer import SamplingParams
from xinfer.model import ConvertsCheckpoint


def synthetic_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """An RGB image with structure (gradients, a bright square) and noise, never constant."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    r = 255 * x / max(width - 1, 1)
    g = 255 * y / max(height - 1, 1)
    b = 127 + 100 * np.sin(x / 5.0) * np.cos(y / 7.0)
    rgb = np.stack([r, g, b], axis=-1) + rng.normal(0, 12, (height, width, 3))
    rgb[height // 4 : height // 2, width // 3 : width // 2] = 250
    return Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8), "RGB")


def load_hf_state(module: torch.nn.Module, hf: torch.nn.Module) -> None:
    """``hf``'s parameters into ``module`` by name, through the ``from_checkpoint`` of the modules
    they are under (as the engine's loader does)."""
    converters = {name: m for name, m in module.named_modules() if isinstance(m, ConvertsCheckpoint)}
    state = {}
    for name, tensor in hf.state_dict().items():
        for prefix, converter in converters.items():
            if name.startswith(f"{prefix}."):
                tensor = converter.from_checkpoint(name[len(prefix) + 1 :], tensor)
        state[name] = tensor
    module.load_state_dict(state, strict=False)
    missing = {name for name, _ in module.named_parameters()} - state.keys()
    assert not missing, f"not in the reference: {sorted(missing)}"


def tiny_vision_config(**overrides):
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig

    fields = dict(depth=3, hidden_size=32, hidden_act="gelu_pytorch_tanh", intermediate_size=64, num_heads=2,
                  patch_size=4, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=24,
                  num_position_embeddings=16, deepstack_visual_indexes=[0, 2])  # fmt: skip
    return Qwen3VLVisionConfig(**{**fields, **overrides})


def randomize_vision(model: torch.nn.Module, seed: int = 1) -> None:
    """LayerNorm weights away from 1 and biases away from 0 (see hf_parity.randomize)."""
    randomize(model, ("norm.weight", "norm1.weight", "norm2.weight", ".bias"), seed)


IMAGE, VIDEO, VISION_START, VISION_END = 300, 301, 302, 303


def tiny_vl_config(**text_overrides):
    """A tiny Qwen3-VL config: 4 text layers, M-RoPE sections (2, 3, 3) over 8 frequencies,
    DeepStack from vision blocks 0 and 2 into text layers 0 and 1."""
    from transformers import Qwen3VLConfig

    text = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True})  # fmt: skip
    vision = tiny_vision_config(out_hidden_size=64).to_dict()
    config = Qwen3VLConfig(text_config={**text, **text_overrides}, vision_config=vision, image_token_id=IMAGE,
                           video_token_id=VIDEO, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)  # fmt: skip
    config.architectures = ["Qwen3VLForConditionalGeneration"]
    return config


PREPROCESSOR = {"size": {"shortest_edge": 8 * 8, "longest_edge": 8 * 8 * 24}, "patch_size": 4,
                "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}  # fmt: skip
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)


def save_randomized(hf, folder):
    randomize(hf, ("norm.weight", "norm1.weight", "norm2.weight", ".bias"))
    hf.save_pretrained(folder, safe_serialization=True)
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))


def text(n: int, seed: int) -> list[int]:
    return torch.randint(0, IMAGE, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def with_images(*pieces: list[int] | str) -> list[int]:
    """Token runs, and an image placeholder (as the chat template writes one) for each "image"."""
    ids: list[int] = []
    for piece in pieces:
        ids += [VISION_START, IMAGE, VISION_END] if piece == "image" else piece
    return ids


def hf_inputs(ids: list[int], images, **processor_kwargs) -> tuple[list[int], dict]:
    """transformers' processor's expansion of the placeholders and its model inputs; ``processor_kwargs``: its
    settings replaced."""
    # (a copy of the size: transformers' processor changes the one it is given)
    processor = Qwen2VLImageProcessorPil(**{**PREPROCESSOR, "size": dict(PREPROCESSOR["size"]), **processor_kwargs})
    inputs = processor(images, return_tensors="pt")
    counts = iter((inputs["image_grid_thw"].prod(-1) // 4).tolist())
    expanded: list[int] = []
    for token in ids:
        expanded += [IMAGE] * next(counts) if token == IMAGE else [token]
    type_ids = (torch.tensor([expanded]) == IMAGE).int()
    return expanded, {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"],
                      "mm_token_type_ids": type_ids}  # fmt: skip


def assert_matches_hf(hf, llm, ids, images, params=GREEDY, atol=1e-4, **processor_kwargs):
    out = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": images}}], params)[0]
    expanded, inputs = hf_inputs(ids, images, **processor_kwargs)
    assert out.prompt_token_ids == expanded
    assert_output_matches_hf(hf, expanded, out.outputs[0], params.max_tokens, atol, **inputs)

"""Shared pieces of the Qwen-VL tests: synthetic images and tiny configs."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from tests.plugins.hf_parity import randomize
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

"""M-RoPE against transformers: the positions of a prompt with images (Qwen3VLModel.get_rope_index)
and the interleaved multimodal rotary (Qwen3-VL's and Qwen3.5's partial one)."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding
from transformers.models.qwen3_vl.modeling_qwen3_vl import (
    Qwen3VLModel,
    Qwen3VLTextRotaryEmbedding,
    apply_rotary_pos_emb,
)

from tests.plugins.qwen.vl_fixtures import IMAGE, VISION_END, VISION_START, tiny_vl_config
from xinfer import ops
from xinfer.layers import RotaryEmbedding, rope_parameters
from xinfer.torch_ops import TorchOps
from xinfer_qwen.mrope import ImagePlacement, MRotaryEmbedding, mrope_positions


@functools.cache
def hf_model() -> Qwen3VLModel:
    return Qwen3VLModel(tiny_vl_config())


def hf_rope_index(ids: list[int], grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, int]:
    model = hf_model()
    input_ids = torch.tensor([ids])
    with torch.inference_mode():
        positions, delta = model.get_rope_index(
            input_ids, (input_ids == IMAGE).int(), image_grid_thw=torch.tensor(grids) if grids else None
        )
    return positions[:, 0], int(delta)


def prompt_with_images(pieces: list[int | tuple[int, int]]) -> tuple[list[int], list[ImagePlacement]]:
    """Text runs (an int: that many tokens) and images (merged (h, w)) in order, each image between
    its vision start and end tokens, as the chat template writes it."""
    ids: list[int] = []
    images = []
    for piece in pieces:
        if isinstance(piece, int):
            ids += [5 + (len(ids) + i) % 200 for i in range(piece)]
        else:
            images.append(ImagePlacement(len(ids) + 1, (1, *piece)))
            ids += [VISION_START, *[IMAGE] * (piece[0] * piece[1]), VISION_END]
    return ids, images


@pytest.mark.parametrize(
    "pieces",
    [[7], [3, (2, 3), 4], [(3, 2), 5, (4, 4), (1, 2), 2], [2, (1, 5)]],
    ids=["text", "one image", "three images", "image last"],
)
def test_positions_and_delta_match_transformers(pieces):
    ids, images = prompt_with_images(pieces)
    expected, expected_delta = hf_rope_index(ids, [(1, 2 * h, 2 * w) for _, h, w in (i.grid for i in images)])
    got, delta = mrope_positions(len(ids), images)
    assert got.tolist() == expected.tolist()
    assert delta == expected_delta


def hf_rotated(rotary, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, rotary_dim: int):
    cos, sin = rotary(q, positions[:, None])  # [1, T, R]
    rot = (q[..., :rotary_dim].transpose(0, 1)[None], k[..., :rotary_dim].transpose(0, 1)[None])
    q_rot, k_rot = apply_rotary_pos_emb(*rot, cos, sin)
    return (torch.cat((q_rot[0].transpose(0, 1), q[..., rotary_dim:]), -1),
            torch.cat((k_rot[0].transpose(0, 1), k[..., rotary_dim:]), -1))  # fmt: skip


def check_rotary(config, hf_rotary, head_dim: int):
    generator = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 300, (3, 11), generator=generator)
    q, k = torch.randn(11, 4, head_dim, generator=generator), torch.randn(11, 2, head_dim, generator=generator)
    params = rope_parameters(config)
    ours = MRotaryEmbedding(RotaryEmbedding(head_dim, 512, params), params["mrope_section"])
    expected = hf_rotated(hf_rotary, positions, q, k, ours.rotary_dim)
    with ops.use(TorchOps()):
        got = ours(positions, q, k)
        text_only = ours(positions[0], q, k)
        text_expected = hf_rotated(hf_rotary, positions[0].expand(3, -1), q, k, ours.rotary_dim)
    for ours_x, hf_x in [*zip(got, expected), *zip(text_only, text_expected)]:
        torch.testing.assert_close(ours_x, hf_x, atol=1e-5, rtol=1e-5)


def test_interleaved_rotary_matches_qwen3_vl():
    config = tiny_vl_config().text_config
    check_rotary(config, Qwen3VLTextRotaryEmbedding(config), config.head_dim)


def test_partial_interleaved_rotary_matches_qwen3_5():
    config = Qwen3_5TextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                                "mrope_section": [3, 3, 2], "mrope_interleaved": True})  # fmt: skip
    check_rotary(config, Qwen3_5TextRotaryEmbedding(config), 32)

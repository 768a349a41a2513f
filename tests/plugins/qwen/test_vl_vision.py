"""The Qwen3-VL vision encoder against transformers' Qwen3VLVisionModel (tiny random config, fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

from tests.plugins.qwen.vl_fixtures import load_hf_state, randomize_vision, synthetic_image, tiny_vision_config
from xinfer import ops
from xinfer.torch_ops import TorchOps
from xinfer_qwen.vl_image import ImageSpec, preprocess
from xinfer_qwen.vl_vision import VisionEncoder


@pytest.fixture(autouse=True)
def torch_ops():
    with ops.use(TorchOps()):
        yield


@pytest.fixture(scope="module")
def encoders():
    torch.manual_seed(0)
    config = tiny_vision_config()
    config._attn_implementation = "eager"
    hf = Qwen3VLVisionModel(config).eval()
    randomize_vision(hf)
    ours = VisionEncoder(config).eval()
    load_hf_state(ours, hf)
    return hf, ours


def reference(hf: Qwen3VLVisionModel, patches: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        out = hf(patches, grid_thw=grids)
    return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)


def test_merged_and_deepstack_features_match_transformers(encoders):
    hf, ours = encoders
    # two images of different grids (one wider than the 4x4 position table, one smaller) and a
    # two-frame clip: the table is resampled per grid, attention stays within each frame
    grids = torch.tensor([[1, 6, 10], [1, 2, 4], [2, 4, 2]])
    patches = torch.randn(int(grids.prod(-1).sum()), 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(3))
    expected = reference(hf, patches, grids)
    with torch.inference_mode():
        got = ours(patches, [tuple(g) for g in grids.tolist()])
    assert got.shape == (int(grids.prod(-1).sum()) // 4, 24 * 3)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_an_image_through_preprocessing_and_encoder_matches_transformers(encoders):
    hf, ours = encoders
    spec = ImageSpec(patch_size=4, min_pixels=8 * 8, max_pixels=8 * 8 * 20)
    image = synthetic_image(45, 30)
    processor = Qwen2VLImageProcessorPil(
        patch_size=4, temporal_patch_size=2, merge_size=2, size={"shortest_edge": 64, "longest_edge": 1280}
    )  # both at transformers' default normalization
    inputs = processor([image], return_tensors="pt")
    expected = reference(hf, inputs["pixel_values"], inputs["image_grid_thw"])
    patches, grids = preprocess([image], spec)
    with torch.inference_mode():
        got = ours(patches, [tuple(g) for g in grids.tolist()])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_an_image_encodes_alike_alone_and_beside_another(encoders):
    _, ours = encoders
    generator = torch.Generator().manual_seed(4)
    a, b = torch.randn(24, 96, generator=generator), torch.randn(16, 96, generator=generator)
    with torch.inference_mode():
        alone = ours(a, [(1, 4, 6)])
        together = ours(torch.cat([b, a]), [(1, 4, 4), (1, 4, 6)])
    torch.testing.assert_close(together[4:], alone, atol=1e-6, rtol=1e-5)


def test_qwen3_5_encoder_has_no_deepstack():
    config = tiny_vision_config(deepstack_visual_indexes=[])
    ours = VisionEncoder(config)
    assert ours.levels == 1 and len(ours.deepstack_merger_list) == 0


@pytest.mark.parametrize(
    "fields",
    [dict(hidden_act="silu"), dict(hidden_act="quick_gelu"), dict(num_position_embeddings=20)],
    ids=["silu", "quick_gelu", "position table of 20 (its first 16 used)"],
)
def test_encoder_config_variants_match_transformers(fields):
    torch.manual_seed(0)
    config = tiny_vision_config(depth=2, deepstack_visual_indexes=[1], **fields)
    config._attn_implementation = "eager"
    hf = Qwen3VLVisionModel(config).eval()
    randomize_vision(hf)
    ours = VisionEncoder(config).eval()
    load_hf_state(ours, hf)
    grids = torch.tensor([[1, 6, 4]])
    patches = torch.randn(24, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        got = ours(patches, [(1, 6, 4)])
    torch.testing.assert_close(got, reference(hf, patches, grids), atol=1e-5, rtol=1e-4)


def test_an_activation_xinfer_lacks_is_one_error():
    with pytest.raises(NotImplementedError, match="hidden_act 'prelu' is not supported"):
        VisionEncoder(tiny_vision_config(hidden_act="prelu"))  # an activation with a weight of its own

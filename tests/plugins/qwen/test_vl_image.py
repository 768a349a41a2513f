"""Qwen-VL image preprocessing against transformers' Qwen2-VL image processor (which Qwen3-VL and
Qwen3.5 use, with their own patch size and normalization)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from tests.plugins.qwen.vl_fixtures import synthetic_image
from xinfer_qwen.vl_image import CLIP, ImageSpec, num_tokens, preprocess, smart_resize

QWEN3_VL = ImageSpec(patch_size=16, min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 64)
QWEN2_VL = ImageSpec(patch_size=14, min_pixels=56 * 56, max_pixels=28 * 28 * 40, normalization=CLIP)


def reference(spec: ImageSpec) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(
        patch_size=spec.patch_size, temporal_patch_size=spec.temporal_patch_size, merge_size=spec.merge_size,
        size={"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels},
        image_mean=list(spec.normalization.mean), image_std=list(spec.normalization.std),
    )  # fmt: skip


# inside the bounds (rounded), too small (scaled up), too large (scaled down), a long strip
SIZES = [(97, 150), (20, 33), (640, 480), (300, 40)]


@pytest.mark.parametrize("spec", [QWEN3_VL, QWEN2_VL], ids=["qwen3-vl", "qwen2-vl"])
def test_patches_and_grids_match_transformers(spec: ImageSpec):
    images = [synthetic_image(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]
    expected = reference(spec)(images, return_tensors="pt")
    patches, grids = preprocess(images, spec)
    assert grids.tolist() == expected["image_grid_thw"].tolist()
    torch.testing.assert_close(patches, expected["pixel_values"].float(), atol=1e-5, rtol=0)


def test_resized_sides_are_multiples_of_the_merged_patch_within_the_pixel_bounds():
    for height, width in [(1, 150), (33, 20), (4000, 3000), (224, 224)]:
        h, w = smart_resize(height, width, QWEN3_VL)
        assert h % 32 == 0 and w % 32 == 0
        assert QWEN3_VL.min_pixels <= h * w <= QWEN3_VL.max_pixels


def test_token_count_is_one_per_merge_group():
    _, grids = preprocess([synthetic_image(97, 150)], QWEN3_VL)
    t, h, w = grids[0].tolist()
    assert num_tokens((t, h, w), QWEN3_VL) == h * w // 4


def test_extreme_aspect_ratio_is_refused():
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2500, QWEN3_VL)


def test_spec_reads_the_preprocessor_config():
    class Vision:
        patch_size, temporal_patch_size, spatial_merge_size = 16, 2, 2

    spec = ImageSpec.from_configs(
        Vision(), {"size": {"shortest_edge": 1024, "longest_edge": 4096}, "image_mean": [0.1, 0.2, 0.3]}
    )
    assert (spec.min_pixels, spec.max_pixels, spec.normalization.mean) == (1024, 4096, (0.1, 0.2, 0.3))


class Vision:
    patch_size, temporal_patch_size, spatial_merge_size = 4, 2, 2


PREPROCESSORS = {
    "bilinear": {"resample": 2},
    "nearest": {"resample": 0},
    "no rescaling": {"do_rescale": False},
    "rescaled by 1/127": {"rescale_factor": 1 / 127},
    "no normalization": {"do_normalize": False},
    "no resizing": {"do_resize": False, "size": {"shortest_edge": 32 * 32, "longest_edge": 40 * 40}},
    # found by fuzzing: transformers takes one number for all channels, xinfer failed to load the checkpoint
    "one mean and std for every channel": {"image_mean": 0.3, "image_std": 0.6},
}


@pytest.mark.parametrize("fields", PREPROCESSORS.values(), ids=PREPROCESSORS.keys())
def test_the_preprocessor_configs_resizing_and_scaling_match_transformers(fields):
    config = {"size": {"shortest_edge": 8 * 8, "longest_edge": 8 * 8 * 24}, "image_mean": [0.2, 0.5, 0.7],
              "image_std": [0.3, 0.5, 0.6], **fields}  # fmt: skip
    images = [synthetic_image(24, 16, seed=1), synthetic_image(56, 48, seed=2)]  # multiples of 8, one over the bounds
    if fields.get("do_resize", True):
        images.append(synthetic_image(37, 23, seed=3))
    expected = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2, **config)(
        images, return_tensors="pt"
    )
    patches, grids = preprocess(images, ImageSpec.from_configs(Vision(), config))
    assert grids.tolist() == expected["image_grid_thw"].tolist()
    torch.testing.assert_close(patches, expected["pixel_values"].float(), atol=1e-5, rtol=0)


def test_an_image_a_model_that_does_not_resize_cannot_patch_is_refused():
    spec = ImageSpec.from_configs(Vision(), {"do_resize": False})
    with pytest.raises(ValueError, match=r"image of 13x9: .* do_resize is false.* multiples of 8"):
        preprocess([synthetic_image(13, 9)], spec)


def test_a_preprocessor_config_without_bounds_or_statistics_takes_transformers_defaults():
    """Found by fuzzing: a checkpoint whose preprocessor config names no size, mean or std was normalized by
    0.5 (transformers: OpenAI CLIP's statistics) and resized within other pixel bounds."""
    config = {"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2}
    images = [synthetic_image(70, 109, seed=1), synthetic_image(1500, 1100, seed=2), synthetic_image(9, 5, seed=3)]
    expected = Qwen2VLImageProcessorPil(**config)(images, return_tensors="pt")
    patches, grids = preprocess(images, ImageSpec.from_configs(Vision(), config))
    assert grids.tolist() == expected["image_grid_thw"].tolist()
    torch.testing.assert_close(patches, expected["pixel_values"].float(), atol=1e-5, rtol=0)


def test_a_size_without_both_bounds_is_refused_as_transformers_refuses_every_image():
    """Found by fuzzing: a size naming only shortest_edge made transformers refuse every image; xinfer resized
    within a default upper bound."""
    config = {"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2, "size": {"shortest_edge": 64}}
    with pytest.raises(ValueError, match="longest_edge"):
        Qwen2VLImageProcessorPil(**config)([synthetic_image(24, 16)], return_tensors="pt")
    with pytest.raises(ValueError, match=r"no pixel bounds .*size \{'shortest_edge': 64\}"):
        ImageSpec.from_configs(Vision(), config)
    with_max = ImageSpec.from_configs(Vision(), {**config, "max_pixels": 640})  # the older key completes it
    assert (with_max.min_pixels, with_max.max_pixels) == (64, 640)


def test_a_min_pixels_of_0_is_refused_as_transformers_refuses_every_image():
    """Found by the one-field sweep: min_pixels 0 overrides size's shortest_edge in transformers, which then
    refuses every image; xinfer took size's bound and served."""
    config = {"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2, "size": {"shortest_edge": 64,
              "longest_edge": 8 * 8 * 24}, "min_pixels": 0}  # fmt: skip
    with pytest.raises(ValueError, match="shortest_edge"):
        Qwen2VLImageProcessorPil(**config)([synthetic_image(24, 16)], return_tensors="pt")
    with pytest.raises(ValueError, match=r"no pixel bounds .* min_pixels 0"):
        ImageSpec.from_configs(Vision(), config)


@pytest.mark.parametrize("mode", ["L", "RGBA", "P"])
def test_an_image_not_in_rgb_is_refused_where_the_preprocessor_does_not_convert_it(mode):
    """Found by the one-field sweep: with do_convert_rgb false transformers keeps the image's own channels, which
    its processor or its 3-channel patch embedding then fails on; xinfer converted the image and served it."""
    config = {"do_convert_rgb": False, "image_mean": 0.5, "image_std": 0.5, "size": {"shortest_edge": 64,
              "longest_edge": 8 * 8 * 24}}  # fmt: skip
    image = synthetic_image(37, 23).convert(mode)
    try:
        channels = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2, **config)(
            [image], return_tensors="pt"
        )["pixel_values"].shape[1] // (2 * 4 * 4)
    except ValueError:
        channels = None
    assert channels != 3
    spec = ImageSpec.from_configs(Vision(), config)
    with pytest.raises(ValueError, match=f"a {mode} image: .*RGB images alone .*do_convert_rgb is false"):
        preprocess([image], spec)
    preprocess([image.convert("RGB")], spec)


@pytest.mark.parametrize("fields", [{"image_mean": [0.5]}, {"image_mean": [0.1, 0.2]}, {"image_std": [0.5] * 4},
                                    {"image_mean": None}])  # fmt: skip
def test_statistics_neither_one_number_nor_one_per_channel_are_refused_as_transformers_refuses_every_image(fields):
    """Found by the one-field sweep: transformers' normalization fails on them; xinfer took a one-element mean as
    the red channel's alone and failed inside a broadcast on the others."""
    config = {"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2, "size": {"shortest_edge": 64,
              "longest_edge": 8 * 8 * 24}, **fields}  # fmt: skip
    with pytest.raises(ValueError):
        Qwen2VLImageProcessorPil(**config)([synthetic_image(24, 16)], return_tensors="pt")
    name = next(iter(fields))
    with pytest.raises(ValueError, match=f"image processor {name} .* neither one number nor 3"):
        ImageSpec.from_configs(Vision(), config)
    with_normalization_off = ImageSpec.from_configs(Vision(), {**config, "do_normalize": False})
    assert with_normalization_off.normalization.mean == (0.0, 0.0, 0.0)  # transformers does not read them then

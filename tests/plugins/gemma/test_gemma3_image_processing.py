"""Gemma 3's image preprocessing (Pillow and torch, ours) against transformers' image processor."""

import pytest
import torch
from PIL import Image

from tests.plugins.gemma.gemma3_vision_model import image, processor
from xinfer.multimodal.image import image_hash
from xinfer_gemma.gemma3_vision import Gemma3ImageProcessor


class _Config:
    class vision_config:
        image_size = 24

    boi_token_index, eoi_token_index, image_token_index, mm_tokens_per_image = 300, 301, 302, 9


def _variants():
    rgb = image(11, (37, 53))
    rgba = rgb.convert("RGBA")
    rgba.putalpha(Image.linear_gradient("L").resize(rgb.size))  # partly transparent
    return {"rgb": rgb, "rgba": rgba, "gray": rgb.convert("L"), "palette": rgb.convert("P"), "small": image(12, (9, 7))}


@pytest.mark.parametrize("name", sorted(_variants()))
def test_pixels_match_transformers(name):
    picture = _variants()[name]
    expected = processor().image_processor(picture, return_tensors="pt")["pixel_values"][0]
    got = Gemma3ImageProcessor(_Config, None).process("image", picture).data["pixel_values"]
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_the_hash_follows_the_pixels_not_the_object():
    assert image_hash(image(1)) == image_hash(image(1))
    assert image_hash(image(1)) != image_hash(image(2))

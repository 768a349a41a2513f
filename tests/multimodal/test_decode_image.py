"""Image bytes decoded as transformers' ``load_image`` reads them (its reference for what a model sees)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image
from transformers.image_utils import load_image

from xinfer.multimodal.image import decode_image


def gradient(width: int, height: int) -> Image.Image:
    rows, columns = np.mgrid[0:height, 0:width]
    pixels = np.stack([rows * 255 // height, columns * 255 // width, (rows + columns) % 256], axis=-1)
    return Image.fromarray(pixels.astype(np.uint8))


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_an_exif_orientation_turns_the_image_upright(orientation):
    """A phone's JPEG stores its pixels as the sensor read them and says how to turn them (Orientation 6: a
    quarter turn clockwise); the model reads them turned, as viewers and transformers show them."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    stored = io.BytesIO()
    gradient(24, 64).save(stored, "PNG", exif=exif.tobytes())
    data = stored.getvalue()
    expected = load_image("data:image/png;base64," + base64.b64encode(data).decode())
    got = decode_image(data)
    assert got.size == expected.size == ((64, 24) if orientation in (6, 8) else (24, 64))
    assert np.array_equal(np.asarray(got.convert("RGB")), np.asarray(expected))

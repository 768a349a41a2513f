"""Image preprocessing for encoders, in Pillow and torch: decode, convert, resize, rescale,
normalise. Each model's processor chains these with its own sizes and statistics."""

from __future__ import annotations

import io
from collections.abc import Sequence

import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor

from xinfer.multimodal.inputs import content_hash

RESAMPLE = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
}


def decode_image(data: bytes, max_pixels: int | None = None) -> Image.Image:
    """The image encoded in ``data`` (PNG, JPEG, WebP, ... whatever Pillow reads), fully
    decoded; ``ValueError`` for data that is not an image, is truncated or corrupt, or has
    more than ``max_pixels`` pixels (checked before decoding the pixels)."""
    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ValueError(
            "the image data is not an image format this server reads (PNG, JPEG, WebP, GIF, BMP)"
        ) from None
    except Image.DecompressionBombError as error:
        raise ValueError(f"the image is too large ({error})") from None
    except Exception as error:  # noqa: BLE001 - Pillow's parsers raise many kinds on broken headers
        raise ValueError(f"the image data is truncated or corrupt ({type(error).__name__}: {error})") from None
    check_pixels(image, max_pixels)
    try:
        image.load()
    except Exception as error:  # noqa: BLE001 - as above, for the pixel data
        raise ValueError(f"the image data is truncated or corrupt ({type(error).__name__}: {error})") from None
    return image


def check_pixels(image: Image.Image, max_pixels: int | None) -> None:
    """``ValueError`` where ``image`` has more than ``max_pixels`` pixels."""
    width, height = image.size
    if max_pixels is not None and width * height > max_pixels:
        raise ValueError(
            f"the image is {width}x{height} = {width * height} pixels, more than the limit of {max_pixels}"
        )


def image_hash(image: Image.Image) -> int:
    """A hash of the image's pixels, size and mode: equal images hash alike whatever file held them."""
    return content_hash(image.mode, *image.size, image.tobytes())


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, transparent pixels composited over white."""
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def resize(image: Image.Image, height: int, width: int, resample: str | int = "bilinear") -> Image.Image:
    """``resample``: a name in :data:`RESAMPLE`, or Pillow's number of a filter (as a checkpoint's
    ``preprocessor_config.json`` writes it)."""
    return image.resize((width, height), resample=RESAMPLE[resample] if isinstance(resample, str) else resample)


def normalized_pixels(
    image: Image.Image, mean: Sequence[float], std: Sequence[float], scale: float = 1 / 255
) -> Tensor:
    """``(pixels * scale - mean) / std`` per channel, as [C, H, W] float32."""
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    pixels = pixels.view(image.height, image.width, len(image.getbands())).permute(2, 0, 1).float()
    mean_t = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)
    return (pixels * scale - mean_t) / std_t

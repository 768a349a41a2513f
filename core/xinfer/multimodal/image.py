"""Image preprocessing for encoders, in Pillow and torch: decode, convert, resize, rescale,
normalise. Each model's processor chains these with its own sizes and statistics."""

from __future__ import annotations

import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageOps, UnidentifiedImageError
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
    decoded and turned upright by its EXIF orientation; ``ValueError`` for data that is not an image, is truncated or corrupt, or has
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
    return ImageOps.exif_transpose(image)  # upright, as viewers show it (and transformers' load_image reads it)


def check_pixels(image: Image.Image, max_pixels: int | None) -> None:
    """``ValueError`` where ``image`` has more than ``max_pixels`` pixels."""
    width, height = image.size
    if max_pixels is not None and width * height > max_pixels:
        raise ValueError(
            f"the image is {width}x{height} = {width * height} pixels, more than the limit of {max_pixels}"
        )


def image_hash(image: Image.Image) -> int:
    """A hash of the image's pixels, size and mode, and of the palette and transparent colour its pixels may
    stand for (a palette image's pixels are indices): equal images hash alike whatever file held them."""
    palette = bytes(image.getpalette("RGBA") or [])
    return content_hash(image.mode, *image.size, image.tobytes(), palette, str(image.info.get("transparency")))


def to_rgb(image: Image.Image, convert: bool = True) -> Image.Image:
    """RGB, transparent pixels composited over white; ``convert`` false (an image processor's ``do_convert_rgb``):
    an image of another mode is refused, as transformers' encoders then fail on its channels."""
    if image.mode == "RGB":
        return image
    if not convert:
        raise ValueError(f"a {image.mode} image: this model takes RGB images alone (its image processor's "
                         f"do_convert_rgb is false)")  # fmt: skip
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


@dataclass(frozen=True)
class Normalization:
    """A processor's pixel scaling: ``(pixels * scale - mean) / std`` per channel."""

    scale: float = 1 / 255
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)

    @classmethod
    def from_preprocessor(
        cls, preprocessor: Mapping[str, Any], default: Normalization, normalize: bool = True
    ) -> Normalization:
        """The checkpoint's image processor fields (``rescale_factor``, ``image_mean``, ``image_std``, a
        list or one number for every channel; ``do_rescale`` or ``do_normalize`` false: that step left
        out), ``default``'s elsewhere; ``normalize``: the processor's ``do_normalize`` where the
        checkpoint's names none."""
        normalize = preprocessor.get("do_normalize", normalize)
        channels = len(default.mean)

        def per_channel(name: str, value: tuple[float, ...]) -> tuple[float, ...]:
            given = preprocessor.get(name, value)
            if isinstance(given, (int, float)) and not isinstance(given, bool):
                return (float(given),) * channels
            if not isinstance(given, Sequence) or len(given) != channels:
                raise ValueError(f"the checkpoint's image processor {name} {given!r} is neither one number nor "
                                 f"{channels} (one per channel), as normalizing needs")  # fmt: skip
            return tuple(given)

        return cls(
            scale=preprocessor.get("rescale_factor", default.scale) if preprocessor.get("do_rescale", True) else 1.0,
            mean=per_channel("image_mean", default.mean) if normalize else (0.0,) * channels,
            std=per_channel("image_std", default.std) if normalize else (1.0,) * channels,
        )

    def __call__(self, image: Image.Image) -> Tensor:
        return normalized_pixels(image, self.mean, self.std, self.scale)


def _beside(config: Any, name: str) -> dict[str, Any]:
    """The JSON file ``name`` beside the checkpoint's ``config.json``; ``{}`` without one."""
    file = Path(getattr(config, "_name_or_path", "") or ".") / name
    return json.loads(file.read_text()) if file.is_file() else {}


def processor_config(config: Any) -> dict[str, Any]:
    """The checkpoint's ``processor_config.json`` (the processor's own settings, such as ``image_seq_length``,
    and in transformers 5 its image processor's); ``{}`` without one."""
    return _beside(config, "processor_config.json")


def preprocessor_config(config: Any) -> dict[str, Any]:
    """The checkpoint's image processor settings beside its ``config.json``: the ``image_processor``
    part of ``processor_config.json`` (as transformers 5 saves a processor), else
    ``preprocessor_config.json``; ``{}`` without either. Fields the run replaces (``mm_processor_kwargs``,
    which the loader puts on the wrapper config) win."""
    settings = processor_config(config)
    saved = (
        settings["image_processor"] if "image_processor" in settings else _beside(config, "preprocessor_config.json")
    )
    return {**saved, **(getattr(config, "mm_processor_kwargs", None) or {})}

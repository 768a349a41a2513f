"""Qwen-VL image preprocessing for the engine (Pillow + torch): an image becomes the flat
patches the vision encoder embeds and its patch grid ``(t, h, w)``.

The image is resized so that both sides are multiples of ``patch_size * merge_size`` (every
2x2 group of patches merges into one language-model token) and its area lies within
``[min_pixels, max_pixels]``, keeping the aspect ratio as closely as it can; then scaled to
[0, 1], normalized, repeated ``temporal_patch_size`` times along time (a still image is a
video of identical frames) and cut into patches. Patches come in merge-group order: the
four patches of a merged token are consecutive.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image
from torch import Tensor

from xinfer.multimodal.image import Normalization, resize, to_rgb

MAX_ASPECT_RATIO = 200
# transformers' Qwen2-VL image processor's statistics (OpenAI CLIP's), where a checkpoint names none
CLIP = Normalization(mean=(0.48145466, 0.4578275, 0.40821073), std=(0.26862954, 0.26130258, 0.27577711))


@dataclass(frozen=True)
class ImageSpec:
    """How a Qwen-VL checkpoint wants its images (``preprocessor_config.json`` and the vision config);
    where the checkpoint names no pixel bounds or statistics, transformers' image processor's."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    resize: bool = True
    convert_rgb: bool = True
    resample: int = Image.Resampling.BICUBIC
    normalization: Normalization = CLIP

    @classmethod
    def from_configs(cls, vision_config: Any, preprocessor: Mapping[str, Any] | None = None) -> ImageSpec:
        """The vision config's patch sizes; resizing, pixel bounds, rescaling and normalization from
        the checkpoint's preprocessor config where it has one (``size`` or the older
        ``min_pixels``/``max_pixels``; ``do_rescale`` and ``do_normalize`` false: left out). A ``size``
        that leaves a bound unnamed is refused, as transformers refuses every image with it."""
        pre = dict(preprocessor or {})
        defaults = cls()
        size = pre.get("size")
        if size is None:
            size = {"shortest_edge": defaults.min_pixels, "longest_edge": defaults.max_pixels}
        min_pixels, max_pixels = (  # the older keys override size's, even with 0, as in transformers
            size.get("shortest_edge") if pre.get("min_pixels") is None else pre["min_pixels"],
            size.get("longest_edge") if pre.get("max_pixels") is None else pre["max_pixels"],
        )
        resize = pre.get("do_resize", True)
        if resize and not (min_pixels and max_pixels):
            raise ValueError(
                f"the checkpoint's image processor gives no pixel bounds to resize images within (size {size}, "
                f"min_pixels {pre.get('min_pixels')}, max_pixels {pre.get('max_pixels')}): both must be named, nonzero"
            )
        for key, field in (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
                           ("merge_size", "spatial_merge_size")):  # fmt: skip
            if pre.get(key, getattr(vision_config, field)) != getattr(vision_config, field):
                raise ValueError(f"the checkpoint's image processor {key} {pre[key]} is not the vision config's "
                                 f"{field} {getattr(vision_config, field)}: the patches would not fit the encoder")  # fmt: skip
        return cls(
            patch_size=vision_config.patch_size,
            temporal_patch_size=vision_config.temporal_patch_size,
            merge_size=vision_config.spatial_merge_size,
            min_pixels=min_pixels or defaults.min_pixels,
            max_pixels=max_pixels or defaults.max_pixels,
            resize=resize,
            convert_rgb=pre.get("do_convert_rgb", True),
            resample=pre.get("resample", defaults.resample),
            normalization=Normalization.from_preprocessor(pre, defaults.normalization),
        )

    @property
    def factor(self) -> int:
        """The side of one merged token, in pixels."""
        return self.patch_size * self.merge_size


def smart_resize(height: int, width: int, spec: ImageSpec) -> tuple[int, int]:
    """The size (height, width) an image of ``height`` x ``width`` is resized to: sides rounded
    to multiples of ``spec.factor``, then scaled down (or up) together, by the square root of
    the area ratio, into ``[min_pixels, max_pixels]``."""
    if max(height, width) > MAX_ASPECT_RATIO * min(height, width):
        raise ValueError(f"image of {width}x{height}: its aspect ratio is over {MAX_ASPECT_RATIO}")
    f = spec.factor
    h, w = round(height / f) * f, round(width / f) * f
    if h * w > spec.max_pixels:
        beta = math.sqrt(height * width / spec.max_pixels)
        h, w = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
    elif h * w < spec.min_pixels:
        beta = math.sqrt(spec.min_pixels / (height * width))
        h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
    return h, w


def pixels(image: Image.Image, spec: ImageSpec) -> Tensor:
    """The image in RGB, resized (on 8-bit pixels as Pillow does), scaled and normalized: [3, H, W] fp32."""
    image = to_rgb(image, spec.convert_rgb)
    if spec.resize:
        image = resize(image, *smart_resize(image.height, image.width, spec), spec.resample)
    elif image.height % spec.factor or image.width % spec.factor:
        raise ValueError(
            f"image of {image.width}x{image.height}: this model does not resize images (its preprocessor's "
            f"do_resize is false), and takes only sides that are multiples of {spec.factor}"
        )
    return spec.normalization(image)


def patchify(image: Tensor, spec: ImageSpec) -> tuple[Tensor, tuple[int, int, int]]:
    """``image`` [C, H, W] as patches [h * w, C * temporal * patch * patch] in merge-group order
    (each patch's values channel, time, row, column), and its grid ``(1, h, w)`` in patches."""
    c, height, width = image.shape
    p, m, t = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    h, w = height // p, width // p
    x = image.reshape(c, h // m, m, p, w // m, m, p)
    x = x.permute(1, 4, 2, 5, 0, 3, 6)  # merge row, merge col, row in group, col in group, C, py, px
    x = x.unsqueeze(5).expand(*x.shape[:5], t, p, p)  # the frame repeated along time
    return x.reshape(h * w, c * t * p * p), (1, h, w)


def preprocess(images: Sequence[Image.Image], spec: ImageSpec) -> tuple[Tensor, Tensor]:
    """The patches of all ``images`` concatenated [N, patch_dim] and their grids [num_images, 3]."""
    patches, grids = zip(*(patchify(pixels(image, spec), spec) for image in images))
    return torch.cat(patches), torch.tensor(grids, dtype=torch.int64)


def num_tokens(grid: Sequence[int], spec: ImageSpec) -> int:
    """The language-model tokens of an image of patch grid ``(t, h, w)``: one per merge group."""
    t, h, w = grid
    return t * h * w // spec.merge_size**2

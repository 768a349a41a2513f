"""Images of chat requests: where they may come from, how many, how large.

``data:`` URLs (base64 PNG, JPEG, WebP, GIF, BMP) always; ``file://`` URLs only under the
directory ``--allowed-local-media-path`` names; ``http(s)://`` URLs only with
``--allow-remote-media``. Every refusal is a 400 naming what is wrong."""

from __future__ import annotations

import base64
import binascii
import json
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from xinfer.multimodal.image import decode_image
from xinfer.server.errors import bad_request

IMAGE_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif", "image/bmp")
DEFAULT_MAX_PIXELS = 4096 * 4096
MAX_IMAGE_BYTES = 32 << 20
REMOTE_TIMEOUT = 10.0  # seconds


@dataclass(frozen=True)
class MediaPolicy:
    allowed_local_path: Path | None = None  # file:// URLs must resolve under it
    allow_remote: bool = False  # fetch http(s) URLs
    limits: dict[str, int] = field(default_factory=lambda: {"image": 4})  # items of each modality per prompt
    max_pixels: int = DEFAULT_MAX_PIXELS

    def check_count(self, modality: str, count: int, param: str) -> None:
        limit = self.limits.get(modality, 0)
        if count > limit:
            raise bad_request(
                f"the request has {count} {modality}s, more than this server takes per prompt ({limit}; "
                f"--limit-mm-per-prompt)",
                param=param,
            )

    def load_image(self, url: str, param: str) -> Image.Image:
        """The image ``url`` points to, decoded; a 400 for anything this policy refuses or Pillow cannot read."""
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            data = _data_url(url, param)
        elif scheme == "file":
            data = self._local_file(url, param)
        elif scheme in ("http", "https"):
            if not self.allow_remote:
                raise bad_request(
                    "image URLs on the network are not fetched by this server (start it with --allow-remote-media): "
                    "send the image as a data: URL",
                    param=param,
                )
            data = _fetch(url, param)
        else:
            raise bad_request(f"unsupported image URL scheme {scheme or url[:20]!r}: use a data: URL", param=param)
        try:
            return decode_image(data, self.max_pixels)
        except ValueError as error:
            raise bad_request(str(error), param=param) from None

    def _local_file(self, url: str, param: str) -> bytes:
        if self.allowed_local_path is None:
            raise bad_request("file:// image URLs are refused: the server allows none (--allowed-local-media-path)",
                              param=param)  # fmt: skip
        parsed = urllib.parse.urlparse(url)
        path = Path(urllib.parse.unquote(parsed.path)).resolve()
        root = self.allowed_local_path.resolve()
        if parsed.netloc not in ("", "localhost") or not path.is_relative_to(root):
            raise bad_request(f"file:// image URLs must name a file under {root}", param=param)
        if not path.is_file():
            raise bad_request(f"no image file at {url}", param=param)
        if path.stat().st_size > MAX_IMAGE_BYTES:
            raise bad_request(f"the image file is larger than {MAX_IMAGE_BYTES} bytes", param=param)
        return path.read_bytes()


def _data_url(url: str, param: str) -> bytes:
    header, sep, payload = url[len("data:") :].partition(",")
    if not sep:
        raise bad_request("a data: URL needs a ',' before its data", param=param)
    media_type, *options = header.split(";")
    media_type = media_type.strip().lower()
    if media_type not in IMAGE_TYPES:
        raise bad_request(
            f"unsupported media type {media_type or '(none)'!r}: images are {', '.join(IMAGE_TYPES)}", param=param
        )
    if "base64" not in options:
        raise bad_request("image data: URLs must be base64 (data:image/png;base64,...)", param=param)
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise bad_request(f"the image is larger than {MAX_IMAGE_BYTES} bytes", param=param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("the image's base64 data is not valid base64", param=param) from None


def _fetch(url: str, param: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=REMOTE_TIMEOUT) as response:
            data = response.read(MAX_IMAGE_BYTES + 1)
    except OSError as error:
        raise bad_request(f"could not fetch the image at {url}: {error}", param=param) from None
    if len(data) > MAX_IMAGE_BYTES:
        raise bad_request(f"the image at {url} is larger than {MAX_IMAGE_BYTES} bytes", param=param)
    return data


def parse_limits(text: str) -> dict[str, int]:
    """``--limit-mm-per-prompt``: ``image=4`` (``,`` between modalities) or vLLM's JSON ``{"image": 4}``."""
    try:
        raw = json.loads(text) if text.strip().startswith("{") else dict(p.split("=", 1) for p in text.split(",") if p)
        limits = {str(k).strip(): int(v) for k, v in raw.items()}
    except (ValueError, AttributeError, TypeError):
        raise ValueError(f'expected MODALITY=N[,MODALITY=N] or JSON like {{"image": 4}}, got {text!r}') from None
    if any(v < 0 for v in limits.values()):
        raise ValueError(f"limits must be at least 0, got {text!r}")
    return limits

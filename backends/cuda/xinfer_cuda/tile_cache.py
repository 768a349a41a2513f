"""Measured tile choices kept on disk: a later start on the same GPU, with the same kernels and software, takes
the tiles an earlier one measured instead of compiling and timing every candidate again (for an 8B GGUF model on
an H100, most of a start's minute): the packed weights' (:class:`~xinfer_cuda.quant_weights.MeasuredTiles`), the
float weights' (:class:`~xinfer_cuda.linear.SmallBatchLinear`) and the experts' (``SmallBatchMoE``).

One JSON file (``$XINFER_TILE_CACHE``, by default ``~/.cache/xinfer/tiles.json``; ``off`` keeps nothing) maps a
measurement's key to the chosen tile's ``repr``. A key names the GPU, the Triton and torch versions and a digest of
the CUDA backend's kernel sources, so that any change to them measures again; a stored tile that is not among the
candidates offered (the candidates changed) is measured again too. Several processes (tensor-parallel ranks) may
write it: each rewrites it whole, merged with what is there, through a rename.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import TypeVar

import torch
import triton

log = logging.getLogger("xinfer")
T = TypeVar("T")


@cache
def kernels_digest() -> str:
    """A digest of the CUDA backend's sources (its kernels and the wrappers that pick their tiles)."""
    root = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted([*root.glob("*.py"), *root.glob("kernels/*.py")]):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


class TileCache:
    """Tile choices by key, read from and written to ``path``."""

    def __init__(self, path: Path):
        self.path = path
        self.choices: dict[str, str] = self._read()

    def _read(self) -> dict[str, str]:
        try:
            stored = json.loads(self.path.read_text())
        except (OSError, ValueError):  # none yet, or not JSON: measured again
            return {}
        if not isinstance(stored, dict):
            return {}
        return {k: v for k, v in stored.items() if isinstance(v, str)}

    @staticmethod
    def key(device: torch.device, *parts: object) -> str:
        """The key of a measurement of ``parts`` on ``device``, with what makes its times what they are."""
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        return repr((name, triton.__version__, torch.__version__, kernels_digest(), *parts))

    def find(self, key: str, options: Sequence[T]) -> list[T]:
        """The option stored for ``key`` (None may be one: the baseline), as a list of one; none where nothing is
        stored or what is stored is not among ``options``."""
        stored = self.choices.get(key)
        return [option for option in options if repr(option) == stored][:1]

    def put(self, key: str, tile: object) -> None:
        self.choices[key] = repr(tile)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            merged = {**self._read(), key: repr(tile)}
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, suffix=".tmp", delete=False) as f:
                json.dump(merged, f, indent=0)
            os.replace(f.name, self.path)
        except OSError as error:  # a read-only home: measured again next start, nothing lost now
            log.debug("tile cache %s not written: %s", self.path, error)


class NotMeasured(Exception):
    """What a measurement raises where it could not time the candidates now (out of memory): its ``choice`` is
    taken, not kept."""

    def __init__(self, choice: object):
        super().__init__(choice)
        self.choice = choice


def remembered(cache: TileCache | None, device: torch.device, parts: tuple, options: Sequence[T],
               measure: Callable[[], T]) -> T:  # fmt: skip
    """The option of ``options`` an earlier start chose for the measurement ``parts`` on ``device`` (kept in
    ``cache``), else what ``measure`` chooses now, then kept (unless it raised :class:`NotMeasured`)."""
    if cache is None:
        return _measured(measure)[0]
    key = cache.key(device, *parts)
    for found in cache.find(key, options):
        return found
    choice, kept = _measured(measure)
    if kept:
        cache.put(key, choice)
    return choice


def _measured(measure: Callable[[], T]) -> tuple[T, bool]:
    """What ``measure`` chooses, and whether to keep it (not where it raised :class:`NotMeasured`)."""
    try:
        return measure(), True
    except NotMeasured as unmeasured:
        return unmeasured.choice, False  # type: ignore[return-value]


def default_tile_cache() -> TileCache | None:
    """The cache at ``$XINFER_TILE_CACHE`` (``off``: none), by default ``~/.cache/xinfer/tiles.json``."""
    setting = os.environ.get("XINFER_TILE_CACHE", "")
    if setting.lower() == "off":
        return None
    xdg = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return TileCache(Path(setting) if setting else xdg / "xinfer" / "tiles.json")


TILE_CACHE = default_tile_cache()  # the process's one: the packed, the float weights' and the experts' choices

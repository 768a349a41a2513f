"""``--m ORG/NAME``: models from the Hugging Face hub, here from a local cache laid out as huggingface_hub lays
out its own (no network here): ``models--ORG--NAME/refs/main`` names a commit, ``snapshots/<commit>/`` holds
the files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants
from transformers import LlamaConfig

from tests.tiny_models import COMMON, save_tiny_model
from xinfer.loading import resolve
from xinfer.loading.loader import check_model
from xinfer.loading.resolve import ModelNotFoundError, resolve_model_path

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cached_snapshot(cache: Path, repo_id: str) -> Path:
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    return snapshot


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An offline hub cache (HF_HUB_CACHE, HF_HUB_OFFLINE=1)."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path


def test_an_hf_checkpoint_in_the_cache_loads_offline(cache):
    snapshot = cached_snapshot(cache, "tiny-org/tiny-llama")
    save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), snapshot)
    path = resolve_model_path("tiny-org/tiny-llama")
    assert path == snapshot
    assert check_model(path).architectures == ["LlamaForCausalLM"]


def test_when_the_hub_cannot_be_reached_the_cache_answers(cache, monkeypatch):
    from huggingface_hub import HfApi

    def unreachable(*args, **kwargs):
        raise ConnectionError("network is unreachable")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(HfApi, "model_info", unreachable)
    snapshot = cached_snapshot(cache, "tiny-org/one-gguf")
    (snapshot / "model-Q4_K_M.gguf").write_bytes(b"GGUF")
    assert resolve_model_path("tiny-org/one-gguf") == snapshot / "model-Q4_K_M.gguf"


def test_f_picks_one_gguf_of_a_repository(cache):
    snapshot = cached_snapshot(cache, "tiny-org/ggufs")
    for name in ("model-Q4_K_M.gguf", "model-Q8_0.gguf"):
        (snapshot / name).write_bytes(b"GGUF")
    with pytest.raises(ModelNotFoundError, match=r"model-Q4_K_M.gguf, model-Q8_0.gguf\); pick one with --f FILE"):
        resolve_model_path("tiny-org/ggufs")
    assert resolve_model_path("tiny-org/ggufs", "model-Q8_0.gguf") == snapshot / "model-Q8_0.gguf"


def test_a_repository_missing_from_the_cache_offline_is_one_line(cache):
    with pytest.raises(ModelNotFoundError) as error:
        resolve_model_path("tiny-org/absent")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("could not get tiny-org/absent from the Hugging Face hub: not in the local hub cache")
    assert "HF_HUB_OFFLINE is set" in message


@pytest.mark.parametrize("m, is_id", [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", True), ("gpt2", True), ("/models/a", False), ("./a/b", False),
    ("a/b/c", False), ("model.gguf", False), ("~/models", False),
])  # fmt: skip
def test_which_names_are_hub_ids(m, is_id):
    assert resolve.is_repo_id(m) is is_id


def test_a_local_folder_wins_over_a_hub_id_of_the_same_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    (tmp_path / "org" / "name" / "config.json").write_text("{}")
    assert resolve_model_path("org/name") == Path("org/name")


def test_a_failed_download_is_one_line_from_the_command_line(tmp_path):
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    code = "import sys; from xinfer.cli import main; sys.exit(main())"
    result = subprocess.run([sys.executable, "-c", code, "--m", "tiny-org/absent"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("xinfer: could not get tiny-org/absent from the Hugging Face hub")


@pytest.mark.parametrize("listing, expected", [
    (["README.md", "config.json", "model.safetensors", "tokenizer.json"], "."),
    (["README.md", "config.json", "model-Q4_K_M.gguf"], "model-Q4_K_M.gguf"),  # a GGUF repository with a config
])  # fmt: skip
def test_the_repository_listing_decides_between_checkpoint_and_gguf(cache, monkeypatch, listing, expected):
    monkeypatch.setattr(resolve, "_repo_files", lambda repo_id: listing)  # as the hub would answer
    snapshot = cached_snapshot(cache, "tiny-org/listed")  # the downloads come from the cache
    for name in listing:
        (snapshot / name).write_bytes(b"GGUF" if name.endswith(".gguf") else b"{}")
    assert resolve_model_path("tiny-org/listed") == (snapshot / expected).resolve()


def test_the_listing_is_the_model_infos_files(monkeypatch):
    """One request, which huggingface_hub does not retry (its tree listing retries a network that is down for
    half a minute, a warning each time)."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import ModelInfo

    names = ["config.json", "model.safetensors"]
    info = ModelInfo(id="tiny-org/listed", siblings=[{"rfilename": name} for name in names])
    monkeypatch.setattr(HfApi, "model_info", lambda self, repo_id: info)
    assert resolve._repo_files("tiny-org/listed") == names

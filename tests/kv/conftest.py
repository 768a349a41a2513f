import pytest
from transformers import LlamaConfig

from tests.tiny_models import COMMON, save_tiny_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny random Llama (head_dim 32, two KV heads) saved once for the KV tests."""
    folder = tmp_path_factory.mktemp("llama")
    save_tiny_model(LlamaConfig(**COMMON, head_dim=32, architectures=["LlamaForCausalLM"]), folder)
    return str(folder)

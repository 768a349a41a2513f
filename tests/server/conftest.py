import json

import pytest
from tokenizers import AddedToken
from transformers import LlamaConfig

from tests.server.live import LiveServer
from tests.tiny_models import save_tiny_model
from xinfer.loading.resolve import default_model_path
from xinfer.text.tokenizer import Tokenizer

API_KEY = "sk-test-key"
MAX_MODEL_LEN = 1024
MAX_BODY_BYTES = 1_000_000
# a DeepSeek-R1-like template: it opens a <think> block, closed when enable_thinking is false
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}"
)


def assert_usage_so_far(chunks: list, prompt_tokens: list[int], n: int, streamed_tokens) -> None:
    """vLLM's continuous usage: a choice's chunk counts its own prompt's tokens and the tokens of that choice
    streamed up to it (``streamed_tokens``: how many a chunk's choice holds); the last chunk, the whole request's."""
    *streamed, last = chunks
    so_far: dict[int, int] = {}
    for chunk in streamed:
        [choice] = chunk.choices
        so_far[choice.index] = so_far.get(choice.index, 0) + streamed_tokens(choice)
        prompt = prompt_tokens[choice.index // n]
        usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens, chunk.usage.total_tokens)
        assert usage == (prompt, so_far[choice.index], prompt + so_far[choice.index]), (choice.index, usage)
    assert sorted(so_far) == list(range(len(prompt_tokens) * n))
    assert last.choices == [] and last.usage.prompt_tokens == sum(prompt_tokens)
    assert last.usage.completion_tokens == sum(so_far.values())


@pytest.fixture(scope="session")
def server():
    """The embedded default model behind an API key."""
    live = LiveServer(
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-body-bytes",
        str(MAX_BODY_BYTES),
        api_key=API_KEY,
        name="server",
    ).start()
    yield live
    live.stop()


@pytest.fixture(scope="session")
def client(server):
    return server.client(timeout=120)


@pytest.fixture(scope="session")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """A random 2-layer Llama over SmolLM2's vocabulary plus <think> and </think>."""
    folder = tmp_path_factory.mktemp("tiny-thinking")
    backend = Tokenizer.from_gguf(default_model_path()).backend
    backend.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    (folder / "tokenizer.json").write_text(backend.to_str())
    config = {"chat_template": THINKING_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    vocab = backend.get_vocab_size(with_added_tokens=True)
    save_tiny_model(
        LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    eos_token_id=backend.token_to_id("<|im_end|>"), architectures=["LlamaForCausalLM"]),
        folder,
    )  # fmt: skip
    live = LiveServer("--m", str(folder), "--max-model-len", "512", "--cpu", name="tiny-thinking").start()
    yield live
    live.stop()


@pytest.fixture(scope="session")
def tiny_client(tiny):
    return tiny.client(timeout=300)

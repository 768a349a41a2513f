"""A prefill server and its decode clients as live servers on 127.0.0.1, over a tiny random model."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import LlamaConfig

from tests.plugins.hf_parity import randomize
from tests.server.live import LiveServer
from tests.tiny_models import COMMON, gemma3_config, save_tiny_model

FLAGS = ("--dtype", "f32", "--kv-fraction", "0.01")
TRANSPORTS = {"shm": "auto", "gloo": "gloo"}  # the transport a client gets: its --pd-transport


def save_model(name: str, folder: Path) -> Path:
    """A tiny random llama or gemma3 (sliding-window blocks) in ``folder``, with a tokenizer."""
    config = LlamaConfig(**COMMON) if name == "llama" else gemma3_config()
    hf = save_tiny_model(config, folder)
    randomize(hf)
    hf.save_pretrained(folder, safe_serialization=True)
    tokenizer = Tokenizer(WordLevel({f"t{i}": i for i in range(COMMON["vocab_size"])}, unk_token="t0"))
    tokenizer.pre_tokenizer = Whitespace()
    (folder / "tokenizer.json").write_text(tokenizer.to_str())  # so that answers carry their tokens
    return folder


def start_pair(
    folder: Path, transports: list[str], *flags: str, server_flags: tuple[str, ...] = (), api_key: str | None = None
) -> tuple[LiveServer, dict[str, LiveServer]]:
    """The prefill server, and a decode client of it per transport; ``flags`` and ``api_key`` for all of them."""
    flags = ("--m", str(folder), *FLAGS, *flags)
    server = LiveServer(*flags, "--pd-server", *server_flags, api_key=api_key, name="pd-server").start()
    clients = {
        transport: LiveServer(*flags, "--pd-client", "--pd-url", server.url, "--pd-transport", asked,
                              api_key=api_key, name=f"pd-client-{transport}")
        for transport, asked in TRANSPORTS.items() if transport in transports
    }  # fmt: skip
    try:
        with ThreadPoolExecutor(len(clients)) as pool:
            list(pool.map(LiveServer.start, clients.values()))
    except BaseException:
        for live in [*clients.values(), server]:
            live.stop()
        raise
    return server, clients


def complete(live: LiveServer, token_ids: list[int], max_tokens: int = 8):
    """A greedy completion of ``token_ids`` with the chosen tokens' logprobs, through the openai client."""
    openai_client = live.client()
    model = openai_client.models.list().data[0].id
    return openai_client.completions.create(
        model=model, prompt=[token_ids], max_tokens=max_tokens, temperature=0, logprobs=1
    )

"""On the GPU: a prefill server and its decode clients on one CUDA device, the cache moved through
CUDA IPC handles (``shm``) and over gloo through pinned host memory: each client's greedy tokens
are one server's. Runs on the GPU machine (the CPU tests cover the rest of the protocol)."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.pd.live_pair import complete, save_model, start_pair
from tests.tiny_models import prompt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run on the GPU machine")


def test_on_the_gpu_each_client_decodes_the_tokens_one_server_gives(tmp_path):
    server, clients = start_pair(save_model("gemma3", tmp_path), ["shm", "gloo"])
    try:
        prompts = [prompt(45, seed=3), prompt(70, seed=4), prompt(100, seed=5)]
        got = {transport: [complete(client, p) for p in prompts] for transport, client in clients.items()}
        expected = [complete(server, p) for p in prompts]
        for transport, answers in got.items():
            for a, b in zip(expected, answers):
                assert b.choices[0].logprobs.tokens == a.choices[0].logprobs.tokens, transport
                assert b.choices[0].logprobs.token_logprobs == pytest.approx(
                    a.choices[0].logprobs.token_logprobs, abs=1e-3
                ), transport
        status = httpx.get(server.url + "/pd/status", timeout=10).json()
        assert sorted(status["clients"].values()) == ["gloo", "shm"] and status["leases"] == 0
    finally:
        for live in [*clients.values(), server]:
            live.stop()

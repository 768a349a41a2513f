"""A prefill server (``--pd-server``) and its decode clients (``--pd-client``) on 127.0.0.1, one
reading the server's cache through shared memory (``--pd-transport auto`` on one host) and, for
one model, one receiving it over gloo: each client's greedy tokens are one server's, the prefill
server counts the prompts, its prefix-cache hits reach the client's usage, shared memory is refused
to another host (gloo offered instead), the blocks a dead client held are freed, a client whose link
was dropped connects again, and a dead prefill server fails only the requests it was prefilling
(503) while the clients keep serving."""

from __future__ import annotations

import datetime
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from torch.distributed import TCPStore

from tests.pd.live_pair import FLAGS, complete, save_model, start_pair
from tests.server.live import LiveServer, free_port
from tests.tiny_models import prompt
from xinfer.distributed.pd import CLIENT, MAX_CLIENTS, transfer_group
from xinfer.distributed.shared_memory import host_id

LEASE_SECONDS = 5  # the prefill server's --pd-timeout: how long a silent client's blocks stay held
MODEL_TRANSPORTS = {"llama": ["shm", "gloo"], "gemma3": ["shm"]}  # the transports move rows whatever the model
API_KEYS = {"gemma3": "pd-pair-key"}  # a pair behind --api-key: the client sends it to the prefill server


def status(server: LiveServer) -> dict:
    return httpx.get(server.url + "/pd/status", headers=server.headers, timeout=10).json()


@pytest.fixture(scope="module", params=list(MODEL_TRANSPORTS))
def pair(request, tmp_path_factory):
    folder = save_model(request.param, tmp_path_factory.mktemp(request.param))
    lease = ("--pd-timeout", str(LEASE_SECONDS))
    server, clients = start_pair(
        folder, MODEL_TRANSPORTS[request.param], "--cpu", server_flags=lease, api_key=API_KEYS.get(request.param)
    )
    yield server, clients, folder
    for live in [*clients.values(), server]:
        live.stop()


def test_each_client_decodes_the_tokens_one_server_gives(pair):
    server, clients, _ = pair
    prompts = [prompt(45, seed=3), prompt(70, seed=4), prompt(5, seed=5)]  # past the window; shorter than a block
    prompt_tokens = server.metrics()["xinfer_prompt_tokens_total"]
    hits = {transport: client.metrics()["xinfer_prefix_cache_hits_total"] for transport, client in clients.items()}
    got = {transport: [complete(client, p) for p in prompts] for transport, client in clients.items()}
    assert server.metrics()["xinfer_prompt_tokens_total"] - prompt_tokens == len(clients) * sum(map(len, prompts))
    expected = [complete(server, p) for p in prompts]
    for transport, client in clients.items():
        # the long prompts' blocks came from the server
        assert client.metrics()["xinfer_prefix_cache_hits_total"] > hits[transport], transport
        for a, b in zip(expected, got[transport]):
            assert len(a.choices[0].logprobs.tokens) == 8
            assert b.choices[0].logprobs.tokens == a.choices[0].logprobs.tokens, transport
            assert b.choices[0].logprobs.token_logprobs == pytest.approx(
                a.choices[0].logprobs.token_logprobs, abs=1e-4
            ), transport
    assert sorted(status(server)["clients"].values()) == sorted(clients)


def test_prefix_cache_hits_of_the_prefill_server_are_reported(pair):
    client = pair[1]["shm"]
    tokens = prompt(50, seed=7)
    first, again = complete(client, tokens, 2), complete(client, tokens, 2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= 32  # the full blocks the server kept


@pytest.mark.parametrize("pair", ["llama"], indirect=True)  # the fallback does not depend on the model
def test_with_fallback_local_an_unreachable_prefill_server_means_prefilling_here(pair):
    server, _, folder = pair
    nowhere = f"http://127.0.0.1:{free_port()}"
    flags = ("--m", str(folder), "--cpu", *FLAGS, "--pd-client", "--pd-url", nowhere, "--pd-fallback", "local")
    client = LiveServer(*flags, name="pd-fallback").start()
    try:
        tokens = prompt(40, seed=30)
        got = complete(client, tokens)
        log = client.log_path.read_text()
        assert f"the prefill server {nowhere} is unreachable" in log and "prefilling here" in log
    finally:
        client.stop()
    assert got.choices[0].logprobs.tokens == complete(server, tokens).choices[0].logprobs.tokens


@pytest.mark.parametrize("pair", ["llama"], indirect=True)  # the transports' choice does not depend on the model
def test_shared_memory_is_refused_to_another_host_which_gets_gloo(pair):
    server = pair[0]
    asked = {"client": "elsewhere", "transport": "shm", "host": "another-host"}
    refused = server.post("/pd/connect", asked)
    assert refused.status_code == 409 and "another host" in refused.json()["error"]["message"]
    offered = server.post("/pd/connect", {**asked, "transport": "auto"})
    assert offered.status_code == 200 and offered.json()["transport"] == "gloo"
    store = TCPStore("127.0.0.1", offered.json()["port"], 2, False, timeout=datetime.timedelta(seconds=30))
    transfer_group(store, CLIENT, "127.0.0.1", 30)  # joined: the server's side is not left waiting
    assert status(server)["clients"]["elsewhere"] == "gloo"


@pytest.mark.parametrize("pair", ["llama"], indirect=True)
def test_a_client_whose_link_was_dropped_connects_again(pair):
    server, clients, _ = pair
    newer = [f"newer{number}" for number in range(MAX_CLIENTS)]
    for client in newer:  # the prefill server drops the links of the clients connected before them
        assert server.post("/pd/connect", {"client": client, "transport": "shm", "host": host_id()}).status_code == 200
    assert sorted(status(server)["clients"]) == sorted(newer)
    tokens = prompt(40, seed=60)
    got = complete(clients["shm"], tokens)  # refused as not connected: connects again, and asks again
    assert got.choices[0].logprobs.tokens == complete(server, tokens).choices[0].logprobs.tokens
    assert set(status(server)["clients"]) - set(newer)


@pytest.mark.parametrize("pair", ["llama"], indirect=True)
def test_the_blocks_a_dead_client_held_are_freed(pair):
    server = pair[0]
    asked = {"client": "doomed", "transport": "shm", "host": host_id()}
    assert server.post("/pd/connect", asked).json()["transport"] == "shm"
    held = server.post("/pd/prefill", {"token_ids": prompt(40, seed=50), "client": "doomed"}).json()
    assert held["num_tokens"] == 32 and held["lease"]  # the client dies here, before reading and releasing
    assert status(server)["leases"] >= 1
    assert server.metrics()["xinfer_kv_cache_usage"] > 0
    deadline = time.monotonic() + LEASE_SECONDS + 10
    while status(server)["leases"] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert status(server)["leases"] == 0
    assert server.metrics()["xinfer_kv_cache_usage"] == 0
    assert f"did not release lease {held['lease']}" in server.log_path.read_text()


def test_a_dead_prefill_server_fails_its_requests_and_the_clients_keep_serving(pair):
    server, clients, _ = pair
    prompts = [prompt(40 + i, seed=20 + i) for i in range(6)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(complete, list(clients.values())[i % len(clients)], p, 4) for i, p in enumerate(prompts)]
        assert server.proc is not None
        server.proc.send_signal(signal.SIGKILL)
        for future in futures:
            try:
                assert future.result().choices[0].finish_reason == "length"
            except openai.APIStatusError as error:
                assert error.status_code == 503 and "prefill server" in error.message
    for client in clients.values():
        with pytest.raises(openai.APIStatusError) as failed:
            complete(client, prompt(30, seed=40))
        assert failed.value.status_code == 503 and "prefill server" in failed.value.message
        assert httpx.get(client.url + "/health", timeout=10).status_code == 200

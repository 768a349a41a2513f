"""Prefill/decode disaggregation: a prefill server computes prompts' caches, a decode client serves
the API and decodes (docs/distributed.md).

Control goes over HTTP: the client asks ``POST /pd/connect`` once (and again after a failure) for
a rendezvous, then ``POST /pd/prefill`` per prompt, answered once the prefill server's prefix
cache holds the prompt. The bytes go over a two-rank ``torch.distributed`` gloo group (server rank
0, client rank 1), one tagged send per prompt (:mod:`xinfer.distributed.kv_transfer`).
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import logging
import socket
from collections.abc import Sequence
from typing import Any, Protocol, cast
from urllib.parse import urlsplit

import httpx
import torch
from fastapi import APIRouter, Request
from pydantic import BaseModel
from torch import Tensor
from torch.distributed import ProcessGroupGloo, TCPStore, Work

from xinfer.distributed.kv_transfer import export_prefix, import_prefix, layout_signature
from xinfer.engine.async_engine import AsyncEngine, EngineUnavailable, RequestHandle
from xinfer.sampling import SamplingParams
from xinfer.server.errors import bad_request

log = logging.getLogger("xinfer")

SERVER, CLIENT = 0, 1


class PrefillFailed(EngineUnavailable):
    """The prefill server could not prefill a prompt (down, or died mid-transfer)."""


class PointToPoint(Protocol):
    """What the transfer uses of a gloo group (torch's stubs do not declare it)."""

    def send(self, tensors: list[Tensor], dst: int, tag: int) -> Work: ...
    def recv(self, tensors: list[Tensor], src: int, tag: int) -> Work: ...


def transfer_group(store: TCPStore, rank: int, address: str, timeout: float) -> PointToPoint:
    """The two-rank gloo group, this side reachable at ``address``; waits for the other side."""
    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # the stubs lack the constructor's options
    options._timeout = datetime.timedelta(seconds=timeout)
    options._devices = [ProcessGroupGloo.create_device(hostname=address)]
    return cast(PointToPoint, ProcessGroupGloo(store, rank, 2, options))


class PrefillRequest(BaseModel):
    token_ids: list[int]


class PrefillServer:
    """``--pd-server``: the routes a decode client calls, beside the usual API."""

    def __init__(self, engine: AsyncEngine, timeout: float):
        self.engine = engine
        self.timeout = timeout
        self.group: asyncio.Future[PointToPoint] | None = None
        self.tags = itertools.count(1)
        self.sending: set[asyncio.Future] = set()

    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/pd/connect", self.connect, methods=["POST"])
        router.add_api_route("/pd/prefill", self.prefill, methods=["POST"])
        return router

    async def connect(self, request: Request) -> dict[str, Any]:
        """A new rendezvous for the client (replacing any earlier one), and this engine's cache layout."""
        layout = await self.engine.call(layout_signature)
        address = request.scope["server"][0]
        store = TCPStore(address, 0, 2, True, timeout=datetime.timedelta(seconds=self.timeout), wait_for_workers=False)
        loop = asyncio.get_running_loop()
        self.group = loop.run_in_executor(None, transfer_group, store, SERVER, address, self.timeout)
        return {"port": store.port, "layout": layout}

    async def prefill(self, body: PrefillRequest) -> dict[str, Any]:
        """Prefills the prompt (one greedy token), then sends its cache to the client."""
        if self.group is None:
            raise bad_request("no decode client is connected: POST /pd/connect first")
        token_ids = body.token_ids
        if not token_ids:
            raise bad_request("token_ids is empty", param="token_ids")
        try:
            handle = await self.engine.submit([(token_ids, SamplingParams(temperature=0, max_tokens=1))])
        except ValueError as error:
            raise bad_request(str(error), param="token_ids") from None
        await self.engine.collect(handle)
        num_tokens, payload = await self.engine.call(lambda engine: export_prefix(engine, token_ids))
        group, tag = await self.group, next(self.tags)
        if payload.numel():
            work = group.send([payload], CLIENT, tag)
            sending = asyncio.get_running_loop().run_in_executor(None, _wait, work, payload)
            self.sending.add(sending)
            sending.add_done_callback(self._sent)
        return {"num_tokens": num_tokens, "cached_tokens": handle.num_cached_tokens, "nbytes": payload.numel(),
                "tag": tag}  # fmt: skip

    def _sent(self, sending: asyncio.Future) -> None:
        self.sending.discard(sending)
        if sending.exception() is not None:
            log.warning("sending a prompt's cache to the decode client failed: %s", sending.exception())


def _wait(work: Work, payload: Tensor) -> None:
    """Waits for a send or receive (``payload`` kept alive until it is done)."""
    work.wait()


class DisaggregatedEngine(AsyncEngine):
    """``--pd-client``: an engine whose prompts are prefilled by the prefill server at ``url``; where
    that fails, the request gets :class:`PrefillFailed` (503), or, with ``fallback_local``, its
    prompt is prefilled here."""

    def __init__(self, *args: Any, url: str, fallback_local: bool = False, timeout: float = 60.0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.url = url.rstrip("/")
        self.host = urlsplit(self.url).hostname or "127.0.0.1"
        self.fallback_local = fallback_local
        self.timeout = timeout
        self.group: PointToPoint | None = None
        self.connecting: asyncio.Lock | None = None
        self.http: httpx.AsyncClient | None = None

    async def submit(self, prompts: Sequence[tuple]) -> RequestHandle:
        self._check_available()
        if any(len(prompt) > 2 and prompt[2] for prompt in prompts):  # images: their embeddings are made here
            return await super().submit(prompts)
        cached: int | None = 0
        for prompt in prompts:
            try:
                cached = (cached or 0) + await self.prefill_remotely(prompt[0])
            except PrefillFailed as error:
                if not self.fallback_local:
                    raise
                log.warning("%s; prefilling here", error)
                cached = None  # as this engine's prefix cache reports
        handle = await super().submit(prompts)
        handle.remote_cached_tokens = cached
        return handle

    async def prefill_remotely(self, token_ids: list[int]) -> int:
        """Has the prefill server prefill ``token_ids`` and registers their cache here; returns the
        prompt tokens the prefill server found in its own prefix cache."""
        group = await self._connection()
        body = await self._post("/pd/prefill", {"token_ids": token_ids})
        payload = torch.empty(body["nbytes"], dtype=torch.uint8)
        if body["nbytes"]:
            try:
                work = group.recv([payload], SERVER, body["tag"])
                await asyncio.get_running_loop().run_in_executor(None, _wait, work, payload)
            except RuntimeError as error:
                self.group = None  # connect again for the next prompt
                raise PrefillFailed(f"the prefill server {self.url} failed while sending a prompt's cache: "
                                    f"{str(error).splitlines()[0]}") from None  # fmt: skip
        await self.call(lambda engine: import_prefix(engine, token_ids, body["num_tokens"], payload))
        return int(body["cached_tokens"])

    async def _connection(self) -> PointToPoint:
        if self.connecting is None:
            self.connecting = asyncio.Lock()
        async with self.connecting:
            if self.group is None:
                body = await self._post("/pd/connect", {})
                layout = await self.call(layout_signature)
                if body["layout"] != layout:
                    raise PrefillFailed(f"the prefill server {self.url} caches another layout (model, "
                                        "--kvcache-dtype or block size differ): "
                                        f"{body['layout']} here {layout}")  # fmt: skip
                self.group = await asyncio.get_running_loop().run_in_executor(None, self._join, body["port"])
            return self.group

    def _join(self, port: int) -> PointToPoint:
        timeout = datetime.timedelta(seconds=self.timeout)
        try:
            store = TCPStore(self.host, port, 2, False, timeout=timeout)
            return transfer_group(store, CLIENT, _local_address(self.host), self.timeout)
        except RuntimeError as error:
            raise PrefillFailed(f"cannot join the prefill server {self.url}'s transfer group: "
                                f"{str(error).splitlines()[0]}") from None  # fmt: skip

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.http is None:
            self.http = httpx.AsyncClient(timeout=self.timeout)
        try:
            response = await self.http.post(self.url + path, json=body)
        except httpx.HTTPError as error:
            self.group = None
            raise PrefillFailed(
                f"the prefill server {self.url} is unreachable: {error or type(error).__name__}"
            ) from None
        if response.status_code == 400:
            raise ValueError(_message(response))
        if response.status_code != 200:
            raise PrefillFailed(f"the prefill server {self.url} answered {response.status_code}: {_message(response)}")
        return response.json()


def _message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]


def _local_address(host: str) -> str:
    """This machine's address on the way to ``host`` (where the prefill server reaches it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), 9))
        return probe.getsockname()[0]

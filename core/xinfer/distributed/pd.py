"""Prefill/decode disaggregation: a prefill server computes prompts' caches, a decode client serves
the API and decodes (docs/distributed.md).

Control goes over HTTP: the client asks ``POST /pd/connect`` once (and again after a failure) for
a link, then ``POST /pd/prefill`` per prompt, answered once the prefill server's prefix cache holds
the prompt. The bytes go one of two ways (:mod:`xinfer.distributed.kv_transfer`):

- ``shm``, both on one host: the prefill server's cache tensors are mapped into the client
  (:mod:`xinfer.distributed.shared_memory`) at connect; per prompt the server holds its blocks
  (a lease), the client copies them device to device and releases the lease
  (``POST /pd/release``), or the lease expires after ``--pd-timeout``.
- ``gloo``, anywhere: a two-rank ``torch.distributed`` gloo group (server rank 0, client rank 1) of
  several TCP pairs, one tagged send per prompt of its cache packed in pinned host memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import itertools
import logging
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast
from urllib.parse import urlsplit

import httpx
import torch
from fastapi import APIRouter, Request
from pydantic import BaseModel
from torch import Tensor
from torch.distributed import ProcessGroupGloo, TCPStore, Work

from xinfer.distributed.kv_transfer import (
    copy_prefix,
    export_prefix,
    held_ids,
    hold_prefix,
    import_prefix,
    layout_signature,
    open_cache,
    rows_of,
    share_cache,
)
from xinfer.distributed.shared_memory import host_id
from xinfer.engine import sequence
from xinfer.engine.async_engine import AsyncEngine, EngineUnavailable, RequestHandle
from xinfer.sampling import SamplingParams
from xinfer.server.errors import APIError, bad_request

if TYPE_CHECKING:
    from xinfer.engine.engine import LLMEngine

log = logging.getLogger("xinfer")

SERVER, CLIENT = 0, 1
TRANSPORTS = ("auto", "gloo", "shm")
Transport = Literal["auto", "gloo", "shm"]
NOT_CONNECTED = "pd_not_connected"  # the error code of a prefill for a client without a link
MAX_CLIENTS = 16  # links a prefill server keeps
NUM_PAIRS = 4  # TCP connections of a gloo group: a prompt goes over one (by its tag), so several overlap


class PrefillFailed(EngineUnavailable):
    """The prefill server could not prefill a prompt (down, or died mid-transfer)."""


class NotConnected(PrefillFailed):
    """The prefill server has no link to this client (it restarted, or dropped the link)."""


class PointToPoint(Protocol):
    """What the transfer uses of a gloo group (torch's stubs do not declare it)."""

    def send(self, tensors: list[Tensor], dst: int, tag: int) -> Work: ...
    def recv(self, tensors: list[Tensor], src: int, tag: int) -> Work: ...


def transfer_group(store: TCPStore, rank: int, address: str, timeout: float) -> PointToPoint:
    """The two-rank gloo group, this side reachable at ``address``; waits for the other side."""
    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # the stubs lack the constructor's options
    options._timeout = datetime.timedelta(seconds=timeout)
    options._devices = [ProcessGroupGloo.create_device(hostname=address) for _ in range(NUM_PAIRS)]
    return cast(PointToPoint, ProcessGroupGloo(store, rank, 2, options))


class ConnectRequest(BaseModel):
    client: str = ""  # the client's id: a new connect of the same client replaces its link
    transport: Transport = "auto"
    host: str = ""  # the client's host_id(): shared memory only where it is the server's


class PrefillRequest(BaseModel):
    token_ids: list[int]
    client: str = ""


class ReleaseRequest(BaseModel):
    lease: int


@dataclass
class Link:
    """The prefill server's side of one client's connection."""

    transport: Literal["gloo", "shm"]
    group: asyncio.Future[PointToPoint] | None = None


@dataclass
class Lease:
    """A prompt's blocks held for a client reading them from shared memory."""

    client: str
    seq: sequence.Sequence
    expiry: asyncio.TimerHandle


class PrefillServer:
    """``--pd-server``: the routes a decode client calls, beside the usual API."""

    def __init__(self, engine: AsyncEngine, timeout: float, transport: Transport = "auto"):
        self.engine = engine
        self.timeout = timeout
        self.transport = transport
        self.links: dict[str, Link] = {}
        self.leases: dict[int, Lease] = {}
        self.tags = itertools.count(1)
        self.background: set[asyncio.Future] = set()  # sends and releases under way, kept alive

    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/pd/connect", self.connect, methods=["POST"])
        router.add_api_route("/pd/prefill", self.prefill, methods=["POST"])
        router.add_api_route("/pd/release", self.release, methods=["POST"])
        router.add_api_route("/pd/status", self.status, methods=["GET"])
        return router

    async def connect(self, body: ConnectRequest, request: Request) -> dict[str, Any]:
        """A new link for the client (replacing any earlier one of it), and this engine's cache layout."""
        layout = await self.engine.call(layout_signature)
        for number in [n for n, lease in self.leases.items() if lease.client == body.client]:
            await self._release(number)  # the client's earlier connection is gone, and what it read
        refusal = self._refuses_shared_memory(body)
        if refusal is None:
            try:
                handles = await self.engine.call(share_cache)
                self._link(body.client, Link("shm"))
                return {"transport": "shm", "layout": layout, "cache": handles}
            except RuntimeError as error:
                refusal = f"its cache cannot be shared: {str(error).splitlines()[0]}"
        if "shm" in (body.transport, self.transport):
            raise APIError(409, f"the prefill server cannot move the cache through shared memory: {refusal}")
        address = request.scope["server"][0]
        store = TCPStore(address, 0, 2, True, timeout=datetime.timedelta(seconds=self.timeout), wait_for_workers=False)
        group = asyncio.get_running_loop().run_in_executor(None, transfer_group, store, SERVER, address, self.timeout)
        self._link(body.client, Link("gloo", group))
        return {"transport": "gloo", "port": store.port, "layout": layout}

    def _link(self, client: str, link: Link) -> None:
        """Links ``client``, dropping the link connected longest ago past MAX_CLIENTS (restarted clients' old ones)."""
        self.links.pop(client, None)
        self.links[client] = link
        while len(self.links) > MAX_CLIENTS:
            self.links.pop(next(iter(self.links)))

    def _refuses_shared_memory(self, body: ConnectRequest) -> str | None:
        if body.transport == "gloo":
            return "the client asks for gloo"
        if self.transport == "gloo":
            return "it runs with --pd-transport gloo"
        if body.host != host_id():
            return "the client runs on another host"
        return None

    async def prefill(self, body: PrefillRequest) -> dict[str, Any]:
        """Prefills the prompt (one greedy token), then sends its cache to the client (gloo) or holds
        it for the client to read (shm)."""
        link = self.links.get(body.client)
        if link is None:  # a client of this server's earlier run: it connects again
            raise APIError(409, "this decode client is not connected: POST /pd/connect first", code=NOT_CONNECTED)
        token_ids = body.token_ids
        if not token_ids:
            raise bad_request("token_ids is empty", param="token_ids")
        try:
            handle = await self.engine.submit([(token_ids, SamplingParams(temperature=0, max_tokens=1))])
        except ValueError as error:
            raise bad_request(str(error), param="token_ids") from None
        await self.engine.collect(handle)
        answer: dict[str, Any] = {"cached_tokens": handle.num_cached_tokens}
        if link.group is None:
            return answer | await self._lease(body.client, token_ids)
        num_tokens, payload = await self.engine.call(lambda engine: export_prefix(engine, token_ids))
        group, tag = await link.group, next(self.tags)
        if payload.numel():
            work = group.send([payload], CLIENT, tag)
            sending = asyncio.get_running_loop().run_in_executor(None, _wait, work, payload)
            self.background.add(sending)
            sending.add_done_callback(self._sent)
        return answer | {"num_tokens": num_tokens, "nbytes": payload.numel(), "tag": tag}

    async def _lease(self, client: str, token_ids: list[int]) -> dict[str, Any]:
        def hold(engine: LLMEngine) -> tuple[sequence.Sequence, int, tuple[list[list[int]], int | None]]:
            seq, num_tokens = hold_prefix(engine, token_ids)
            if not num_tokens:
                engine.cache.release(seq)
            return seq, num_tokens, held_ids(engine, seq)

        seq, num_tokens, (blocks, slot) = await self.engine.call(hold)
        if not num_tokens:
            return {"num_tokens": 0}
        number = next(self.tags)
        expiry = asyncio.get_running_loop().call_later(self.timeout, self._expire, number)
        self.leases[number] = Lease(client, seq, expiry)
        return {"num_tokens": num_tokens, "lease": number, "blocks": blocks, "slot": slot, "held_for": self.timeout}

    async def release(self, body: ReleaseRequest) -> dict[str, Any]:
        """The client has copied a prompt's blocks: they are the prefix cache's again."""
        await self._release(body.lease)
        return {}

    async def status(self) -> dict[str, Any]:
        """The connected clients' transports, and the leases they hold."""
        return {"clients": {client: link.transport for client, link in self.links.items()}, "leases": len(self.leases)}

    def _expire(self, number: int) -> None:
        log.warning("a decode client did not release lease %d within %g s (dead?): its blocks are freed",
                    number, self.timeout)  # fmt: skip
        task = asyncio.ensure_future(self._release(number))
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _release(self, number: int) -> None:
        lease = self.leases.pop(number, None)
        if lease is None:
            return
        lease.expiry.cancel()
        with contextlib.suppress(EngineUnavailable):  # else the engine and its cache are gone
            await self.engine.call(lambda engine: engine.cache.release(lease.seq))

    def _sent(self, sending: asyncio.Future) -> None:
        self.background.discard(sending)
        if sending.exception() is not None:
            log.warning("sending a prompt's cache to the decode client failed: %s", sending.exception())


def _wait(work: Work, payload: Tensor) -> None:
    """Waits for a send or receive (``payload`` kept alive until it is done)."""
    work.wait()


@dataclass
class SharedCache:
    """The prefill server's cache tensors mapped into the decode client, as :func:`cache_tensors` orders them."""

    groups: list[list[Tensor]]
    states: list[Tensor]


class DisaggregatedEngine(AsyncEngine):
    """``--pd-client``: an engine whose prompts are prefilled by the prefill server at ``url``; where
    that fails, the request gets :class:`PrefillFailed` (503), or, with ``fallback_local``, its
    prompt is prefilled here."""

    def __init__(self, *args: Any, url: str, fallback_local: bool = False, timeout: float = 60.0,
                 transport: Transport = "auto", api_key: str | None = None, **kwargs: Any):  # fmt: skip
        super().__init__(*args, **kwargs)
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}  # the pair shares its --api-key
        self.host = urlsplit(self.url).hostname or "127.0.0.1"
        self.fallback_local = fallback_local
        self.timeout = timeout
        self.transport = transport
        self.id = uuid.uuid4().hex
        self.link: PointToPoint | SharedCache | None = None
        self.host_buffer: Callable[[tuple[int, ...], torch.dtype], Tensor] | None = None  # the engine's backend's
        self.connecting: asyncio.Lock | None = None
        self.http: httpx.AsyncClient | None = None
        self.releasing: set[asyncio.Future] = set()

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
        link = await self._connection()
        try:
            body = await self._post("/pd/prefill", {"token_ids": token_ids, "client": self.id})
        except NotConnected:
            link = await self._connection()  # once more, on a new link
            body = await self._post("/pd/prefill", {"token_ids": token_ids, "client": self.id})
        num_tokens = body["num_tokens"]
        if isinstance(link, SharedCache):
            if num_tokens:
                held_until = time.monotonic() + body["held_for"] / 2  # its clock started before the answer
                sources = rows_of(link.groups, link.states, (body["blocks"], body["slot"]))
                try:
                    await self.call(lambda engine: copy_prefix(engine, token_ids, num_tokens, sources, held_until))
                except ValueError as error:
                    raise PrefillFailed(f"the prefill server {self.url}'s cache was not copied: {error}") from None
                finally:
                    self._release(body["lease"])
            return int(body["cached_tokens"])
        nbytes = body["nbytes"]
        assert self.host_buffer is not None, "_connect binds it with the gloo link"
        payload = self.host_buffer((nbytes,), torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        if nbytes:
            try:
                work = link.recv([payload], SERVER, body["tag"])
                await asyncio.get_running_loop().run_in_executor(None, _wait, work, payload)
            except RuntimeError as error:
                self.link = None  # connect again for the next prompt
                raise PrefillFailed(f"the prefill server {self.url} failed while sending a prompt's cache: "
                                    f"{str(error).splitlines()[0]}") from None  # fmt: skip
        await self.call(lambda engine: import_prefix(engine, token_ids, num_tokens, payload))
        return int(body["cached_tokens"])

    def _release(self, lease: int) -> None:
        """Gives the prefill server its blocks back, without holding up the request."""
        task = asyncio.ensure_future(self._post("/pd/release", {"lease": lease}))
        self.releasing.add(task)
        task.add_done_callback(self._released)

    def _released(self, task: asyncio.Future) -> None:
        self.releasing.discard(task)
        if task.exception() is not None:
            log.warning("releasing a prompt's blocks on the prefill server failed: %s", task.exception())

    async def _connection(self) -> PointToPoint | SharedCache:
        if self.connecting is None:
            self.connecting = asyncio.Lock()
        async with self.connecting:
            if self.link is None:
                self.link = await self._connect(self.transport)
            return self.link

    async def _connect(self, transport: Transport) -> PointToPoint | SharedCache:
        body = await self._post("/pd/connect", {"client": self.id, "transport": transport, "host": host_id()})
        layout = await self.call(layout_signature)
        if body["layout"] != layout:
            raise PrefillFailed(f"the prefill server {self.url} caches another layout (model, "
                                f"--kvcache-dtype or block size differ): {body['layout']} here {layout}")  # fmt: skip
        if body["transport"] == "shm":
            try:
                shared = SharedCache(*await self.call(lambda engine: open_cache(engine, body["cache"])))
            except RuntimeError as error:
                reason = f"cannot map the prefill server {self.url}'s cache: {str(error).splitlines()[0]}"
                if transport == "shm":
                    raise PrefillFailed(reason) from None
                log.warning("%s; moving caches over gloo", reason)
                return await self._connect("gloo")
            log.info("the prefill server %s's cache comes through shared memory", self.url)
            return shared
        self.host_buffer = await self.call(lambda engine: engine.ops.host_buffer)  # gloo payloads land there
        group = await asyncio.get_running_loop().run_in_executor(None, self._join, body["port"])
        log.info("the prefill server %s's cache comes over gloo", self.url)
        return group

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
            self.http = httpx.AsyncClient(timeout=self.timeout, headers=self.headers)
        try:
            response = await self.http.post(self.url + path, json=body)
        except httpx.HTTPError as error:
            self.link = None
            raise PrefillFailed(
                f"the prefill server {self.url} is unreachable: {error or type(error).__name__}"
            ) from None
        if response.status_code == 400:
            raise ValueError(_message(response))
        if response.status_code != 200:
            self.link = None  # connect again for the next prompt
            failed = NotConnected if _error(response, "code") == NOT_CONNECTED else PrefillFailed
            raise failed(f"the prefill server {self.url} answered {response.status_code}: {_message(response)}")
        return response.json()


def _message(response: httpx.Response) -> str:
    return _error(response, "message") or response.text[:200]


def _error(response: httpx.Response, field: str) -> str | None:
    """A field of the standard error body, if the response has one."""
    try:
        return str(response.json()["error"][field])
    except (ValueError, KeyError, TypeError):
        return None


def _local_address(host: str) -> str:
    """This machine's address on the way to ``host`` (where the prefill server reaches it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), 9))
        return probe.getsockname()[0]

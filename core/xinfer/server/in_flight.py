"""The HTTP requests a server is answering. A shutdown waits for them all, not only for the engine's work: a
request between two rounds of MCP tool calls, or waiting on a tool, has nothing in the engine. While it drains,
a request that comes on an open connection is a 503; those already in flight go on, their later rounds included."""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Receive, Scope, Send

from xinfer.server.serving import unavailable

UNCOUNTED = frozenset({"/health", "/metrics"})  # probes: they say the server drains, and hold nothing


class InFlight:
    def __init__(self) -> None:
        self.count = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    def begin_drain(self) -> None:
        self.draining = True

    async def wait_idle(self, timeout: float) -> bool:
        """Waits until no request is in flight; False if ``timeout`` ran out first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def enter(self) -> None:
        self.count += 1
        self._idle.clear()

    def leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()


class InFlightMiddleware:
    def __init__(self, app: ASGIApp, in_flight: InFlight):
        self.app, self.in_flight = app, in_flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNCOUNTED:
            await self.app(scope, receive, send)
            return
        if self.in_flight.draining:
            error = unavailable(RuntimeError("the server is shutting down: it takes no new requests"))
            await error.response(scope["path"])(scope, receive, send)
            return
        self.in_flight.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight.leave()

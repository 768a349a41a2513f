"""A streamed answer tied to its engine request."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from xinfer.engine.async_engine import AsyncEngine, RequestHandle
from xinfer.server import sse


class EngineStreamResponse(StreamingResponse):
    """SSE whose engine request is released however the response ends: finished,
    client gone (Starlette cancels the stream), or never started at all."""

    def __init__(self, events: AsyncIterator[str], engine: AsyncEngine, handle: RequestHandle):
        super().__init__(events, media_type="text/event-stream", headers=sse.HEADERS)
        self.engine = engine
        self.handle = handle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.engine.release(self.handle)

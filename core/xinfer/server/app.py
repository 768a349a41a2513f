"""The FastAPI application: routes, error shapes, API key, body limit, CORS."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.middleware.cors import CORSMiddleware

from xinfer import __version__
from xinfer.engine.async_engine import EngineUnavailable
from xinfer.server.auth import APIKeyMiddleware
from xinfer.server.body import DEFAULT_MAX_BODY_BYTES
from xinfer.server.disconnect import ClientDisconnected
from xinfer.server.errors import install_error_handlers
from xinfer.server.in_flight import InFlight, InFlightMiddleware
from xinfer.server.responses_api.store import ResponseStore
from xinfer.server.routes import ROUTERS
from xinfer.server.serving import Serving, unavailable

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"


def build_app(
    serving: Serving,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    with_ui: bool = False,
    allowed_origins: Sequence[str] = ("*",),
    in_flight: InFlight | None = None,
) -> FastAPI:
    """The app serving ``serving``; browsers on ``allowed_origins`` (as vLLM's and llama.cpp's servers, every
    one by default) may call it from their pages' scripts. ``in_flight``: the requests it is answering, counted
    with other apps' (the API's and the chat UI's), for a shutdown to wait for."""
    app = FastAPI(title="xinfer", version=__version__, docs_url="/docs", redoc_url=None)
    app.state.serving = serving
    app.state.responses = ResponseStore()
    app.state.max_body_bytes = max_body_bytes
    install_error_handlers(app)

    @app.exception_handler(EngineUnavailable)
    async def engine_unavailable(request: Request, error: EngineUnavailable) -> Response:
        return unavailable(error).response(request.url.path)

    @app.exception_handler(ClientDisconnected)
    async def client_gone(_: Request, __: ClientDisconnected) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    for router in ROUTERS:
        app.include_router(router)
    if with_ui:
        from xinfer.server.ui import mount_ui

        mount_ui(app, api_key)
    app.add_middleware(InFlightMiddleware, in_flight=in_flight or InFlight())
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    if allowed_origins:  # outside the key check (added last): a browser's preflight carries no key
        app.add_middleware(
            CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"], allow_headers=["*"]
        )
    return app

"""API key check (``--api-key``): ``Authorization: Bearer KEY`` or ``x-api-key: KEY``.

Health, metrics and the chat UI's own files stay open, so that probes and the page
that asks for the key can load.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from xinfer.server.errors import APIError

OPEN_PATHS = frozenset({"/health", "/metrics", "/", "/index.html", "/favicon.ico"})
OPEN_PREFIXES = ("/ui/",)


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in OPEN_PATHS or path.startswith(OPEN_PREFIXES) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        message = "a valid API key is required: send Authorization: Bearer <key> or x-api-key: <key>"
        error = APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await error.response(path)(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])
        bearer = headers.get(b"authorization", b"")
        given = bearer[7:].strip() if bearer[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
        # compare_digest takes time independent of where the keys differ
        return hmac.compare_digest(given, self.key)

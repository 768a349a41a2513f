"""Built-in chat web UI (``xinfer --ui-server``).

The UI is a static page (plain ES modules, no build step) shipped in ``static/``.
:func:`mount_ui` adds it to a FastAPI app that also serves the OpenAI-compatible
API routes, so the page talks to the API on the same origin.

Routes added:

* ``GET /``               -> ``static/index.html``
* ``GET /ui/static/...``  -> the page's scripts and styles
* ``GET /ui/config.json`` -> ``{"api_key": "..." | null}``; the page sends the key
  as ``Authorization: Bearer ...``. Anyone who can load the page can read the key,
  so the UI port should only be exposed to people who may use the API.
"""

from __future__ import annotations

import mimetypes
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().parent / "static"

# Scripts, styles and connections only from this origin; no inline script, no
# plugins, no framing. Images only from this origin or data: URLs (the page never
# loads remote images from model output; it renders them as links).
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'"
)

_SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # Revalidate every time so an upgraded package's UI is picked up at once
    # (the files are small, and ETag/Last-Modified make revalidation cheap).
    "Cache-Control": "no-cache",
}


def mount_ui(app: FastAPI, api_key: str | None) -> None:
    """Serve the chat UI from *app*: ``/``, ``/ui/static/*`` and ``/ui/config.json``."""
    # Some systems map .js to text/plain, and browsers refuse module scripts
    # served that way (with nosniff): pin the types the page needs.
    mimetypes.add_type("text/javascript", ".js")
    mimetypes.add_type("text/css", ".css")
    mimetypes.add_type("image/svg+xml", ".svg")

    index = STATIC_DIR / "index.html"
    if not index.is_file():  # pragma: no cover - packaging error
        raise RuntimeError(f"xinfer UI files are missing: {index} not found")

    class _UIStatic(StaticFiles):
        async def get_response(self, path, scope):
            response = await super().get_response(path, scope)
            for name, value in _SECURITY_HEADERS.items():
                response.headers.setdefault(name, value)
            return response

    async def ui_index() -> FileResponse:
        return FileResponse(index, media_type="text/html", headers=dict(_SECURITY_HEADERS))

    async def ui_config() -> JSONResponse:
        return JSONResponse({"api_key": api_key or None}, headers={"Cache-Control": "no-store"})

    app.add_api_route("/", ui_index, methods=["GET"], include_in_schema=False)
    app.add_api_route("/index.html", ui_index, methods=["GET"], include_in_schema=False)
    app.add_api_route("/ui/config.json", ui_config, methods=["GET"], include_in_schema=False)
    app.mount("/ui/static", _UIStatic(directory=STATIC_DIR), name="xinfer-ui-static")

"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure a client can cause is an :class:`APIError` with its status; FastAPI's
422 and Starlette's plain-text 404/405 are rewritten into the same shape, and an
unexpected exception becomes a 500 that names no internals.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

log = logging.getLogger("xinfer")

# the rest are "invalid_request_error" below 500, "internal_error" from 500 on
ERROR_TYPES = {429: "rate_limit_error", 503: "service_unavailable"}


@dataclass(eq=False)
class APIError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def from_validation(error: ValidationError | RequestValidationError) -> APIError:
    """The first problem pydantic found, as ``field.path: what is wrong``."""
    problems = error.errors()
    first = problems[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        return bad_request(f"the body is not valid JSON: {first.get('ctx', {}).get('error', message)}")
    if first.get("type") == "model_type" and not loc:
        return bad_request("the body must be a JSON object")
    more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
    return bad_request(f"{param}: {message}{more}" if param else f"{message}{more}", param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        return from_validation(error).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        message = str(error.detail)
        if error.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif error.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return APIError(error.status_code, message, headers=getattr(error, "headers", None)).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return APIError(500, f"internal error ({type(error).__name__}); see the server log").response()

"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``, and in
Anthropic's (``{"type": "error", "error": {"type", "message"}}``) on the Messages API's routes.

Every failure a client can cause is an :class:`APIError` with its status; FastAPI's
422 and Starlette's plain-text 404/405 are rewritten into the same shape, and an
unexpected exception becomes a 500 that says what failed in one line (its traceback goes
to the server log, once).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request as ASGIRequest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from xinfer.engine.async_engine import EngineUnavailable
from xinfer.engine.failures import RequestError, describe
from xinfer.server.disconnect import ClientDisconnected

log = logging.getLogger("xinfer")

# OpenAI's error types; the rest are "invalid_request_error" below 500, "server_error" from 500 on
ERROR_TYPES = {429: "rate_limit_error", 503: "service_unavailable_error"}
# Anthropic's error types by status; "invalid_request_error" for the other 4xx, "api_error" for the other 5xx
ANTHROPIC_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                         413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}  # fmt: skip
ANTHROPIC_PATHS = "/v1/messages"  # the routes (and those under it) that answer in Anthropic's shape


@dataclass(eq=False)
class APIError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self, path: str = "") -> dict:
        """The error's body in the shape of the API that ``path`` belongs to."""
        if is_anthropic(path):  # Anthropic's error has no param: the message names the field
            named = self.param is None or self.message.startswith(self.param)
            return anthropic_error_body(self.status, self.message if named else f"{self.param}: {self.message}")
        return error_body(self.status, self.message, self.param, self.code)

    def response(self, path: str = "") -> JSONResponse:
        return JSONResponse(self.body(path), status_code=self.status, headers=self.headers)


def is_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PATHS or path.startswith(ANTHROPIC_PATHS + "/")


def anthropic_error_body(status: int, message: str) -> dict:
    kind = ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class FieldError(ValueError):
    """A body's problem found by a check of several fields (a model validator), naming the field at fault
    (``param``, dotted, below the validated object), which pydantic cannot tell from where it was raised."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


MAX_DETAIL = 300  # characters of an unexpected exception's message told to the client


def internal_error(error: Exception, where: str) -> APIError:
    """A 500 for an unexpected exception: logged with its traceback, told to the client in one line (its type and
    the first line of its message), never the traceback."""
    detail = describe(error)
    log.error("%s failed: %s", where, detail, exc_info=error)
    if len(detail) > MAX_DETAIL:
        detail = detail[: MAX_DETAIL - 3] + "..."
    return APIError(500, f"internal server error in {where}: {detail} (the traceback is in the server log)")


def server_failure(error: Exception, where: str) -> APIError:
    """What a request gets for an exception its route did not answer (or a stream that already answered 200 sends
    as its error event): its own error, a 503 for an engine that stopped, a 500 for a request the engine failed
    (its reason, which the engine logged) or for anything else."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, EngineUnavailable):
        return APIError(503, str(error))
    if isinstance(error, ClientDisconnected):  # nobody reads the event: nothing to log
        return APIError(499, "the client went away")
    if isinstance(error, RequestError):
        return APIError(500, str(error))
    return internal_error(error, where)


class AnswersUnexpectedErrors:
    """Answers a request whose handling raised what no exception handler took with :func:`server_failure`'s error
    body. A handler for ``Exception`` would answer too, but Starlette then raises the exception again for the
    server, and uvicorn logs its traceback a second time. One whose response had started is raised on."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as error:
            if started:
                raise
            request = ASGIRequest(scope)
            failure = server_failure(error, f"{request.method} {request.url.path}")
            await failure.response(request.url.path)(scope, receive, send)


def from_validation(error: ValidationError | RequestValidationError) -> APIError:
    """The first problem pydantic found, as ``field.path: what is wrong``."""
    problems = error.errors()
    if isinstance(error, RequestValidationError):  # FastAPI's: each location starts with where (query, path)
        problems = [problem | {"loc": tuple(problem.get("loc", ()))[1:]} for problem in problems]
    paths = [path(problem) for problem in problems]
    deepest = max(range(len(problems)), key=lambda i: len(paths[i]))
    first, loc = problems[0], paths[0]
    if sum(len(p) == len(paths[deepest]) for p in paths) == 1:
        # one alternative of a union got further into the value than the others (a list of blocks, where a
        # string was the first alternative): its problem is the one the client made
        first, loc = problems[deepest], paths[deepest]
    else:
        for shared in paths[1:]:  # the alternatives of one union (``prompt.str``, ``prompt.list[int]``): their field
            common = next((i for i, (a, b) in enumerate(zip(loc, shared)) if a != b), min(len(loc), len(shared)))
            loc = loc[:common] if common else loc
    param = ".".join(loc) or None
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        return bad_request(f"the body is not valid JSON: {first.get('ctx', {}).get('error', message)}")
    if first.get("type") == "model_type" and not loc:
        return bad_request("the body must be a JSON object")
    more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
    message += given(first)
    return bad_request(f"{param}: {message}{more}" if param else f"{message}{more}", param)


def path(problem: Any) -> list[str]:
    """Where a problem is in the body, as fields and indexes: without the union alternatives' tags (``str``,
    ``list[Block]``), and with the field that a :class:`FieldError` names."""
    loc = [str(p) for p in problem.get("loc", ()) if p != "body" and not (isinstance(p, str) and is_union_tag(p))]
    cause = problem.get("ctx", {}).get("error")
    return loc + cause.param.split(".") if isinstance(cause, FieldError) else loc


def is_union_tag(part: str) -> bool:
    return "[" in part or part in ("str", "int", "float", "bool", "dict", "list", "none")


def given(problem: Any) -> str:
    """``, got VALUE`` (as JSON) for a problem with a single value (a number, a string: cut at 80 characters)."""
    value = problem.get("input")
    if problem.get("type") == "missing" or not (value is None or isinstance(value, str | int | float)):
        return ""
    text = json.dumps(value)
    return f", got {text if len(text) <= 80 else text[:77] + '...'}"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return from_validation(error).response(request.url.path)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        message = str(error.detail)
        if error.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif error.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        error_headers = getattr(error, "headers", None)
        return APIError(error.status_code, message, headers=error_headers).response(request.url.path)

    app.add_middleware(AnswersUnexpectedErrors)

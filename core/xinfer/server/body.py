"""Reading a JSON request body: size limit (413), content type and JSON (400), a client gone mid-body (499)."""

from __future__ import annotations

import json
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from xinfer.server.disconnect import ClientDisconnected
from xinfer.server.errors import APIError, bad_request, from_validation

Body = TypeVar("Body", bound=BaseModel)

DEFAULT_MAX_BODY_BYTES = 16 << 20


async def parse_body(request: Request, model: type[Body]) -> Body:
    raw = await read_limited(request, request.app.state.max_body_bytes)
    content_type = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if content_type != "application/json" and not content_type.endswith("+json"):
        raise bad_request(f"the body must be JSON sent as Content-Type: application/json, not {content_type!r}")
    if not raw.strip():
        raise bad_request("the request body is empty")
    try:
        return model.model_validate_json(raw)
    except ValidationError as error:
        if not too_deep(error):
            raise from_validation(error) from None
    # pydantic's JSON parser stops at a fixed depth (about 200 levels: a deep JSON schema in response_format or
    # tools reaches it); Python's parser, which vLLM's FastAPI bodies go through, goes as deep as its stack
    try:
        data = json.loads(raw)
        return model.model_validate(data)
    except RecursionError:
        raise bad_request("the body nests too deeply to parse") from None
    except ValidationError as error:
        raise from_validation(error) from None


def too_deep(error: ValidationError) -> bool:
    return any(e["type"] == "json_invalid" and "recursion limit" in e["msg"] for e in error.errors())


async def read_limited(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(int(declared), limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(size, limit)
            chunks.append(chunk)
    except ClientDisconnect:  # the client left (or broke its framing) mid-body: nobody reads an answer
        raise ClientDisconnected() from None
    return b"".join(chunks)


def too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"the body has {size} bytes or more, the limit is {limit} bytes", code="request_too_large")

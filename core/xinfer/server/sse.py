"""Server-sent events as OpenAI streams them: ``data: {json}`` blocks, then ``data: [DONE]``."""

from __future__ import annotations

import json

from pydantic import BaseModel

DONE = "data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(payload: BaseModel | dict) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"

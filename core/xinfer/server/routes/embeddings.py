"""``POST /v1/embeddings``: the final hidden state, mean- or last-token pooled."""

from __future__ import annotations

import asyncio
import base64

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from xinfer.server.body import parse_body
from xinfer.server.errors import bad_request
from xinfer.server.prompts import encode_prompts
from xinfer.server.protocol import EmbeddingRequest
from xinfer.server.responses import Embedding, EmbeddingList, usage
from xinfer.server.serving import Serving

router = APIRouter()


@router.post("/v1/embeddings")
async def create_embeddings(request: Request) -> JSONResponse:
    serving: Serving = request.app.state.serving
    body = await parse_body(request, EmbeddingRequest)
    serving.check_model(body.model)
    inputs = await asyncio.to_thread(encode_prompts, lambda: serving.tokenizer, body.input, serving.vocab_size, "input")
    for tokens in inputs:
        if len(tokens) > serving.max_model_len:
            message = f"the input has {len(tokens)} tokens, the model's context is {serving.max_model_len} tokens"
            raise bad_request(message, param="input", code="context_length_exceeded")
    hidden_size = serving.llm.hf_config.hidden_size
    if body.dimensions is not None and body.dimensions != hidden_size:
        raise bad_request(f"this model's embeddings have {hidden_size} dimensions", param="dimensions")
    states = await serving.embed(request, inputs)
    data = [
        Embedding(index=i, embedding=encode(pool(hidden, body.pooling, body.normalize), body.encoding_format))
        for i, hidden in enumerate(states)
    ]
    num_tokens = sum(len(t) for t in inputs)
    result = EmbeddingList(data=data, model=serving.model_name, usage=usage(num_tokens, 0))
    # OpenAI's embedding usage: prompt_tokens and total_tokens only
    usage_fields = {"prompt_tokens_details", "completion_tokens", "completion_tokens_details"}
    return JSONResponse(result.model_dump(exclude={"usage": usage_fields}))


def pool(hidden: torch.Tensor, pooling: str, normalize: bool) -> torch.Tensor:
    vector = hidden.mean(0) if pooling == "mean" else hidden[-1]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def encode(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # little-endian float32, as OpenAI sends it
        return base64.b64encode(vector.to(torch.float32).numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()

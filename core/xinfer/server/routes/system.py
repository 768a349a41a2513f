"""``GET`` (or ``HEAD``) ``/health``, ``GET /metrics``, ``GET /v1/models``, ``GET /version``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from xinfer import __version__
from xinfer.server.responses import ModelCard, ModelList
from xinfer.server.serving import Serving

router = APIRouter()


@router.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers that probe so
async def health(request: Request) -> JSONResponse:
    """200 when the engine takes requests; 503 while loading, draining, stalled or dead."""
    engine = request.app.state.serving.engine
    healthy, status = engine.health()
    body = {"status": "ok" if healthy else status}
    if engine.error:
        body["error"] = engine.error
    return JSONResponse(body, status_code=200 if healthy else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.serving.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    return JSONResponse(ModelList(data=[model_card(request.app.state.serving)]).model_dump())


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": __version__})


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> JSONResponse:
    serving: Serving = request.app.state.serving
    serving.check_model(model)
    return JSONResponse(model_card(serving).model_dump())


def model_card(serving: Serving) -> ModelCard:
    loaded = serving.engine.engine is not None
    return ModelCard(
        id=serving.model_name,
        created=serving.started,
        root=serving.model_root,
        max_model_len=serving.max_model_len if loaded else None,
        input_modalities=["text", *serving.llm.modalities] if loaded else ["text"],
    )

"""The router's HTTP side (ASGI): health and Prometheus metrics; the OpenAI API mounts here too."""

from __future__ import annotations

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST

from router.metrics import RouterMetrics
from router.pool import WorkerPool


def build_app(metrics: RouterMetrics, pool: WorkerPool, model_name: str) -> FastAPI:
    app = FastAPI(title="pdserve router", version="0.1.0")

    @app.get("/health")
    async def health() -> Response:
        ready = pool.has_role("decode")
        return Response(status_code=200 if ready else 503, content=b"ok" if ready else b"no decode worker")

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(content=metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app

"""The router's HTTP side (ASGI): health, Prometheus metrics, the critical-path breakdown and the OpenAI-compatible API."""

from __future__ import annotations

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from router.openai.routes import mount
from router.service import RouterService


def build_app(service: RouterService) -> FastAPI:
    # FastAPI's own OpenTelemetry spans (with tracing on): one per HTTP request, the parent of its
    # `generate` span; none for health checks and Prometheus scrapes, no per-operation spans
    app = FastAPI(title="pdserve router", version="0.1.0", telemetry={"operation_spans": False, "exclude": _untraced})
    metrics, pool = service.metrics, service.pool

    @app.get("/health")
    async def health() -> Response:
        ready = pool.has_role("decode")
        return Response(status_code=200 if ready else 503, content=b"ok" if ready else b"no decode worker")

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(content=metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/pdserve/critical_path")
    async def critical_path(window_s: float = 60.0) -> JSONResponse:
        """The last `window_s` seconds' critical-path breakdown and verdict (what `pdserve status` shows)."""
        return JSONResponse(metrics.critical_path.breakdown(max(1.0, min(window_s, metrics.critical_path.horizon_s))))

    @app.middleware("http")
    async def require_api_key(request: Request, call_next):
        if request.url.path.startswith("/v1/") and not service.settings.authorized(request.headers.get("authorization")):
            error = {"message": "authorization: missing or invalid API key (send 'Authorization: Bearer KEY')",
                     "type": "authentication_error", "param": None, "code": "invalid_api_key"}
            return JSONResponse({"error": error}, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)

    mount(app, service)
    return app


def _untraced(scope) -> bool:
    return scope.get("path") in ("/health", "/metrics")

"""/health (liveness), /ready (readiness, with load progress), /metrics, /version."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kubeinfer import __version__
from kubeinfer.runtime.server.state import ServerState

router = APIRouter()


def get_state(request: Request) -> ServerState:
    return request.app.state.server


@router.get("/health")
async def health(state: ServerState = Depends(get_state)) -> JSONResponse:
    """Liveness: 200 while the process can serve or is loading; 503 once loading or the engine
    failed (a tensor-parallel rank that exited included), or while the engine has work but has
    finished no step for `engine_stall_timeout` (a hung engine: the liveness probe restarts the
    pod). A hung load is the startup probe's (it asks /ready, within the operator's startup
    budget)."""
    if state.load_error is not None:
        return JSONResponse({"status": "failed", "error": state.load_error}, status_code=503)
    if state.engine is not None and (failure := state.engine.failure) is not None:
        return JSONResponse({"status": "failed", "error": str(failure)}, status_code=503)
    if (stalled := state.stalled_for()) is not None:
        body = {"status": "stalled", "error": f"no engine step finished for {stalled:.0f}s"}
        return JSONResponse(body, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/ready")
async def ready(state: ServerState = Depends(get_state)) -> JSONResponse:
    """200 only when weights are loaded, the engine runs and the server is not draining."""
    if state.is_ready:
        return JSONResponse({"status": "ready", "model": state.model_name})
    body: dict[str, object] = {"loaded_bytes": state.loaded_bytes, "total_bytes": state.total_bytes}
    if state.draining:
        body["status"] = "draining"
    elif state.load_error is not None:
        body.update(status="failed", error=state.load_error)
    else:
        body["status"] = "loading"
    return JSONResponse(body, status_code=503)


@router.get("/metrics")
async def metrics(state: ServerState = Depends(get_state)) -> Response:
    fault = state.settings.metrics_fault_file
    if fault is not None and fault.exists():  # the test hook: scrapes fail, serving goes on
        return Response("metrics blocked (--metrics-fault-file)\n", status_code=503)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}

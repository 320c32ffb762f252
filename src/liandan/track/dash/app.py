"""The dashboard's web application (Starlette): the page and its assets from fixed files, the JSON API under
/api. A token, when the server has one, is asked of every API request (header `Authorization: Bearer T`,
`X-Liandan-Token: T` or `?token=T`); on a loopback address only requests naming a loopback host are answered,
so that a web page elsewhere cannot reach the API through a name that resolves to this machine."""

from __future__ import annotations

import asyncio
import hmac
import importlib.util
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from liandan.track.dash.api import MAX_BODY, MAX_POINTS, MAX_STEP, ApiError, Dashboard, parse_int, parse_x

STATIC = Path(__file__).resolve().parent / "static"
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1", "[::1]")
STREAM_S = 60.0  # the longest one event stream stays open
BODY_S = 5.0  # the longest a request body may take to arrive (a comparison's is a few hundred bytes)


def plotly_bundle() -> Path:
    """plotly.js as the `plotly` Python package ships it (nothing is fetched from the network)."""
    spec = importlib.util.find_spec("plotly")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("No module named 'plotly'", name="plotly")
    path = Path(next(iter(spec.submodule_search_locations))) / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise ModuleNotFoundError(f"the plotly package has no {path.name}", name="plotly")
    return path


def create_app(dash: Dashboard, token: str | None = None, loopback: bool = True) -> Starlette:
    assets = {"app.js": STATIC / "app.js", "style.css": STATIC / "style.css", "plotly.min.js": plotly_bundle()}

    def page(request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    def asset(request: Request) -> Response:
        path = assets.get(request.path_params["file"])
        if path is None:
            raise HTTPException(404)
        return FileResponse(path, headers={"Cache-Control": "no-cache"})

    def name(request: Request) -> str:
        return dash.check_run(request.path_params["name"])

    def query(request: Request, key: str, low: int, high: int, default: int | None = None) -> int | None:
        return parse_int(request.query_params.get(key), key, low, high, default)

    def api(handler: Callable[[Request], Any]) -> Callable[[Request], Response]:
        def endpoint(request: Request) -> Response:
            return JSONResponse(handler(request), headers={"Cache-Control": "no-store"})

        return endpoint

    def curve(request: Request) -> Any:
        run = name(request)
        return dash.curve(run, request.query_params.get("key", "loss"), parse_x(request.query_params.get("x")),
                          query(request, "start", -MAX_STEP, MAX_STEP), query(request, "end", -MAX_STEP, MAX_STEP),
                          query(request, "max_points", 1, MAX_POINTS, 2000))  # fmt: skip

    def layers(request: Request) -> Any:
        run = name(request)
        return dash.layers(run, query(request, "around", 0, MAX_STEP), query(request, "window", 0, 10_000, 50))

    def experts(request: Request) -> Any:
        return dash.experts(name(request), query(request, "step", 0, MAX_STEP))

    async def compare(request: Request) -> Response:
        body = b""
        try:
            async with asyncio.timeout(BODY_S):  # a body shorter than its Content-Length would hold the request
                async for chunk in request.stream():
                    body += chunk
                    if len(body) > MAX_BODY:
                        raise ApiError(413, f"request body over {MAX_BODY} bytes")
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {BODY_S:.0f}s") from None
        except ClientDisconnect:
            return Response(status_code=400)  # the client left: nobody reads an answer
        return JSONResponse(await run_in_threadpool(dash.compare, body), headers={"Cache-Control": "no-store"})

    async def stream(request: Request) -> Response:
        """Server-sent events: one `progress` message whenever the run's step, status or incidents change,
        checked every second; the stream ends after `STREAM_S` (browsers reconnect on their own) or when the
        run stops, so that no connection outlives the server's shutdown by long."""
        run = await run_in_threadpool(name, request)

        async def messages():
            last = None
            began = time.monotonic()
            while time.monotonic() - began < STREAM_S and not await request.is_disconnected():
                now = await run_in_threadpool(dash.progress, run)
                if now != last:
                    yield f"event: progress\ndata: {json.dumps(now)}\n\n"
                    last = now
                if now["status"] != "running":
                    return
                await asyncio.sleep(1.0)

        return StreamingResponse(messages(), media_type="text/event-stream", headers={"Cache-Control": "no-store"})

    routes = [
        Route("/", page),
        Route("/favicon.ico", lambda r: Response(status_code=204)),
        Route("/static/{file}", asset),
        Route("/api/runs", api(lambda r: {"project": str(dash.project), "runs": dash.runs()})),
        Route("/api/runs/{name}", api(lambda r: dash.run(name(r)))),
        Route("/api/runs/{name}/curve", api(curve)),
        Route("/api/runs/{name}/incidents", api(lambda r: {"incidents": dash.incidents(name(r))})),
        Route("/api/runs/{name}/incidents/{seq}",
              api(lambda r: dash.incident(name(r), parse_int(r.path_params["seq"], "seq", 0, 2**62)))),
        Route("/api/runs/{name}/evaluations", api(lambda r: {"evaluations": dash.evaluations(name(r))})),
        Route("/api/runs/{name}/checkpoints", api(lambda r: {"checkpoints": dash.checkpoints(name(r))})),
        Route("/api/runs/{name}/forecasts", api(lambda r: {"forecasts": dash.forecasts(name(r))})),
        Route("/api/runs/{name}/health", api(lambda r: dash.health(name(r)))),
        Route("/api/runs/{name}/layers", api(layers)),
        Route("/api/runs/{name}/experts", api(experts)),
        Route("/api/runs/{name}/stream", stream),
        Route("/api/compare", compare, methods=["POST"]),
    ]  # fmt: skip

    async def guard(request: Request, call_next) -> Response:
        if loopback and _host(request.headers.get("host", "")) not in LOOPBACK_NAMES:
            return _error(403, "this dashboard answers only requests for its loopback address")
        if token is not None and request.url.path.startswith("/api") and not _token_ok(request, token):
            return _error(401, "missing or wrong token: pass it as ?token=T or the header Authorization: Bearer T")
        return await call_next(request)

    async def api_error(request: Request, err: Exception) -> Response:
        assert isinstance(err, ApiError)
        return _error(err.status, err.message)

    async def http_error(request: Request, err: Exception) -> Response:
        assert isinstance(err, HTTPException)
        message = {404: "not found", 405: "method not allowed"}.get(err.status_code, str(err.detail))
        return _error(err.status_code, f"{message}: {request.method} {request.url.path[:200]}")

    async def server_error(request: Request, err: Exception) -> Response:
        return _error(500, f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else 'no message'}")

    return Starlette(
        routes=routes,
        middleware=[Middleware(BaseHTTPMiddleware, dispatch=guard)],
        exception_handlers={ApiError: api_error, HTTPException: http_error, Exception: server_error},
    )


def _host(header: str) -> str:
    if header.startswith("["):
        return header.split("]", 1)[0] + "]"
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _token_ok(request: Request, token: str) -> bool:
    given = request.headers.get("x-liandan-token") or request.query_params.get("token") or ""
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        given = auth[7:].strip()
    return hmac.compare_digest(given.encode("utf-8", "replace"), token.encode("utf-8"))


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers={"Cache-Control": "no-store"})

"""The run inspector's web server: the page (``ui/static``) and a read-only JSON API over an MLflow tracking store.

``ppoflow ui`` serves it on 127.0.0.1 (``--host`` to expose it; it only ever reads). Every route is a GET; the
page renders logged strings as text (never as HTML) and the Content-Security-Policy forbids inline and foreign
scripts, so a response containing ``<script>`` is shown, not run. A request must name the server by a loopback name
(or the ``--host`` it listens on, or an ``--allowed-host``) in its Host header: a page elsewhere that rebinds its DNS
name to 127.0.0.1 cannot read the store. What the API echoes of the tracking URI has its password replaced.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from flows.secrets import redact_text
from ui.store import RunStore

STATIC = Path(__file__).resolve().parent / "static"
LINK_CHECK_EVERY_S = 30.0
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1", "[::1]")
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "object-src 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


@dataclass
class Links:
    """Where the other UIs are, for the page's links."""

    mlflow_url: str = "http://127.0.0.1:5000"
    prefect_url: str = "http://127.0.0.1:4200"
    ray_dashboard_url: str = "http://127.0.0.1:8265"

    @classmethod
    def from_environment(cls) -> Links:
        return cls(
            mlflow_url=os.environ.get("PPOFLOW_MLFLOW_UI_URL", cls.mlflow_url),
            prefect_url=os.environ.get("PREFECT_UI_URL", cls.prefect_url).removesuffix("/api"),
            ray_dashboard_url=os.environ.get("RAY_DASHBOARD_URL", cls.ray_dashboard_url),
        )


class SecurityHeaders(BaseHTTPMiddleware):
    async def dispatch(self, request: Request, call_next: Any) -> Any:
        response = await call_next(request)
        response.headers.update(SECURITY_HEADERS)
        return response


def answers(url: str, timeout_s: float = 0.5) -> bool:
    """Whether something serves ``url`` (any HTTP answer below 500): the page shows only links that open."""
    import httpx

    try:
        return httpx.get(url, timeout=timeout_s).status_code < 500
    except httpx.HTTPError:
        return False


class LiveLinks:
    """``links`` as the page gets them: a UI that does not answer is None (asked again every LINK_CHECK_EVERY_S)."""

    def __init__(self, links: Links):
        self.links, self.found, self.checked_at = links, {}, -LINK_CHECK_EVERY_S

    def __call__(self) -> dict[str, str | None]:
        if time.monotonic() - self.checked_at >= LINK_CHECK_EVERY_S:
            self.found = {name: url if answers(url) else None for name, url in asdict(self.links).items()}
            self.checked_at = time.monotonic()
        return self.found


def run_ids(request: Request) -> list[str]:
    """The runs a request names (``?run=<id>``, one or more); a LookupError (400) when it names none."""
    ids = request.query_params.getlist("run")
    if not ids:
        raise LookupError("name at least one run: ?run=<run id>")
    return ids


def api(handler: Callable[[Request], Any]) -> Callable[[Request], Awaitable[JSONResponse]]:
    """An endpoint answering ``handler(request)`` as JSON, computed in a thread (the store's reads block); a
    LookupError is a 400 with its message, any other error a 404 that names it (the server never crashes on one)."""

    async def endpoint(request: Request) -> JSONResponse:
        try:
            return JSONResponse(await run_in_threadpool(handler, request))
        except LookupError as error:
            return JSONResponse({"error": str(error)}, status_code=400)
        except Exception as error:  # an unknown run or experiment, an unreadable artifact
            return JSONResponse({"error": f"{type(error).__name__}: {error}"}, status_code=404)

    return endpoint


def create_app(
    tracking_uri: str,
    links: Links | None = None,
    default_experiment: str = "ppoflow",
    allowed_hosts: list[str] | None = None,
) -> Starlette:
    """The app over the store at ``tracking_uri``; requests must name it by a loopback name or one of
    ``allowed_hosts``."""
    store = RunStore(tracking_uri)
    live_links = LiveLinks(links or Links.from_environment())

    def settings(request: Request) -> dict[str, Any]:
        return {**live_links(), "default_experiment": default_experiment, "tracking_uri": redact_text(tracking_uri)}

    routes = [
        Route("/", lambda request: FileResponse(STATIC / "index.html"), methods=["GET"]),
        Route("/api/settings", api(settings), methods=["GET"]),
        Route("/api/experiments", api(lambda request: store.experiments()), methods=["GET"]),
        Route(
            "/api/runs",
            api(lambda request: store.runs(request.query_params.get("experiment", default_experiment))),
            methods=["GET"],
        ),
        Route(
            "/api/curves",
            api(
                lambda request: store.curves(
                    run_ids(request),
                    request.query_params.getlist("key"),
                    int(request.query_params.get("max_points", 1000)),
                )
            ),
            methods=["GET"],
        ),
        Route("/api/metric-keys", api(lambda request: store.metric_keys(run_ids(request))), methods=["GET"]),
        Route("/api/timeline", api(lambda request: store.timeline(run_ids(request)[0])), methods=["GET"]),
        Route("/api/sample-steps", api(lambda request: store.sample_steps(run_ids(request)[0])), methods=["GET"]),
        Route(
            "/api/samples",
            api(lambda request: store.samples(run_ids(request)[0], int(request.query_params["step"]))),
            methods=["GET"],
        ),
        Route("/api/config-diff", api(lambda request: store.config_diff(run_ids(request))), methods=["GET"]),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    hosts = [*LOOPBACK_NAMES, *(allowed_hosts or [])]
    return Starlette(
        routes=routes, middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=hosts), Middleware(SecurityHeaders)]
    )


def serve(
    tracking_uri: str,
    host: str = "127.0.0.1",
    port: int = 8420,
    links: Links | None = None,
    default_experiment: str = "ppoflow",
    allowed_hosts: list[str] | None = None,
) -> None:
    import uvicorn

    allowed = list(allowed_hosts or [])
    if host not in LOOPBACK_NAMES:
        print(
            f"ppoflow ui: listening on {host}, reachable from other machines (the page shows every logged prompt and "
            "response)"
        )
        allowed.append(host)
    print(f"ppoflow ui: http://{host}:{port}/ (runs of {redact_text(tracking_uri)})")
    uvicorn.run(create_app(tracking_uri, links, default_experiment, allowed), host=host, port=port, log_level="warning")

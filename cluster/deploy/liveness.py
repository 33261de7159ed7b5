"""The liveness probe as an application of its own: GET /health off the ingress's event loop.

The HTTP ingress answers GET /health in its ASGI guard, before any other work, but what
precedes the guard on that replica's loop (connection set-up, HTTP parsing, Ray Serve's
per-request wrapper) is not kvray's to pace: a burst of thousands of requests makes a few
turns of that loop last seconds, and a probe arriving then waits them out (docs/benchmarks.md,
"Overload"). A liveness probe that fails under load makes Kubernetes restart healthy pods
exactly when they are busiest.

So every kvray deployment (`kvray serve`, `kvray config`, the Helm chart, the bench's
--launch) runs a second, tiny Serve application on the route `<prefix>/health`: one
zero-CPU replica that answers {"status": "ok"} and does nothing else. Serve's HTTP routing
(HAProxy's and Serve's own proxy's) takes the longest matching route prefix, so GET /health
reaches this replica, in its own process, whatever the ingress is doing; everything else
still goes to the kvray application on "/". The ingress keeps its own GET /health (an
application deployed without this one still answers it).

What it tells: this pod's proxy routes requests and Serve runs the application. Engine
health is Serve's own business (LLMServer.check_health replaces a replica whose engine is
dead or stalled) and readiness is GET /ready, which asks an engine replica.
"""

from __future__ import annotations

from typing import Any

from ray import serve

LIVENESS_PATH = "/health"
LIVENESS_BODY = b'{"status":"ok"}'
DEPLOYMENT_NAME = "Liveness"
IMPORT_PATH = "cluster.app:build_liveness_app"
# Probes are tiny and never queue behind anything: the cap only bounds a flood of them.
MAX_ONGOING_REQUESTS = 1024


def liveness_app_name(app_name: str) -> str:
    """The liveness application that goes with the kvray application `app_name`."""
    return f"{app_name}-liveness"


def liveness_route(route_prefix: str) -> str:
    """The route of the liveness application for a kvray application on `route_prefix`."""
    return route_prefix.rstrip("/") + LIVENESS_PATH


class Liveness:
    """GET (or HEAD) of the route itself: 200 {"status": "ok"}; anything else: an error in
    OpenAI's format, as the ingress would give."""

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse, Response

        from cluster.http.ingress import http_error_body

        below = request.url.path[len(request.scope.get("root_path", "")) :]
        if below not in ("", "/"):
            return JSONResponse(http_error_body(404, "Not Found"), status_code=404)
        if request.method not in ("GET", "HEAD"):
            return JSONResponse(
                http_error_body(405, "Method Not Allowed"),
                status_code=405,
                headers={"Allow": "GET, HEAD"},
            )
        return Response(LIVENESS_BODY, media_type="application/json")


def build_liveness_app(args: dict[str, Any] | None = None) -> serve.Application:
    """Serve application builder (one parameter, as Serve requires; it takes no args)."""
    if args:
        raise ValueError(f"the liveness application takes no args, got {sorted(args)}")
    deployment = serve.deployment(
        Liveness,
        name=DEPLOYMENT_NAME,
        num_replicas=1,
        max_ongoing_requests=MAX_ONGOING_REQUESTS,
        # Must not hold a CPU an engine replica could use.
        ray_actor_options={"num_cpus": 0},
        health_check_period_s=10.0,
    )
    return deployment.bind()


def liveness_app_spec(app_name: str, route_prefix: str) -> dict[str, Any]:
    """Its entry in a Serve config's `applications:` (what `kvray config` and the chart write)."""
    return {
        "name": liveness_app_name(app_name),
        "route_prefix": liveness_route(route_prefix),
        "import_path": IMPORT_PATH,
    }


def liveness_target(app_name: str, route_prefix: str) -> serve.RunTarget:
    """It as a `serve.run_many` target, deployed next to the kvray application."""
    return serve.RunTarget(
        build_liveness_app(),
        name=liveness_app_name(app_name),
        route_prefix=liveness_route(route_prefix),
    )


def run_liveness_app(app_name: str, route_prefix: str) -> None:
    """Deploys it next to a running kvray application (blocking until up)."""
    serve.run_many([liveness_target(app_name, route_prefix)])

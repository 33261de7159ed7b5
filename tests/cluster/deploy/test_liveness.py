"""The liveness application's routes and answers, without Ray (the live check, with the HTTP
ingress stopped, is in tests/cluster/cli/test_config.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from starlette.requests import Request

from cluster.deploy.liveness import (
    Liveness,
    build_liveness_app,
    liveness_app_spec,
    liveness_route,
)


def _answer(method: str, path: str, root_path: str = "/health") -> tuple[int, Any]:
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "root_path": root_path,
        "headers": [],
        "query_string": b"",
    }
    response = asyncio.run(Liveness()(Request(scope)))
    return response.status_code, json.loads(response.body) if response.body else None


@pytest.mark.parametrize(
    ("prefix", "route"), [("/", "/health"), ("/main", "/main/health"), ("/a/", "/a/health")]
)
def test_route_sits_below_the_kvray_application(prefix: str, route: str) -> None:
    assert liveness_route(prefix) == route
    assert liveness_app_spec("kvray", prefix) == {
        "name": "kvray-liveness",
        "route_prefix": route,
        "import_path": "cluster.app:build_liveness_app",
    }


def test_get_and_head_of_the_route_answer_ok() -> None:
    assert _answer("GET", "/health") == (200, {"status": "ok"})
    assert _answer("GET", "/health/") == (200, {"status": "ok"})
    assert _answer("GET", "/main/health", root_path="/main/health") == (200, {"status": "ok"})
    assert _answer("HEAD", "/health")[0] == 200


def test_anything_else_is_an_openai_error() -> None:
    status, body = _answer("POST", "/health")
    assert status == 405 and body["error"]["type"] == "invalid_request_error"
    status, body = _answer("GET", "/health/v1/models")
    assert status == 404 and body["error"]["type"] == "not_found_error"


def test_builder_takes_no_args() -> None:
    build_liveness_app(None)
    build_liveness_app({})
    with pytest.raises(ValueError, match="num_replicas"):
        build_liveness_app({"num_replicas": 2})

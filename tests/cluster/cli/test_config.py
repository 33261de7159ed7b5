"""`kvray config` writes a Serve config that validates, deploys and answers; the deployed app
(1 replica, tiny queue) also shows admission control: 429 + Retry-After under a flood while
/health stays 200, and its liveness application answers /health while the HTTP ingress
cannot answer anything."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from cluster.cli import config as config_cmd
from tests.cluster.serve_helpers import (
    KV_CACHE_BYTES,
    App,
    ServePorts,
    openai_client,
    pids_matching,
)


def _config_yaml(tmp: Path, *flags: str) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    config_cmd.add_arguments(parser)
    out = tmp / "kvray.yaml"
    assert config_cmd.run(parser.parse_args([*flags, "-o", str(out)])) == 0
    text = out.read_text()
    assert text.startswith("# kvray Serve application")
    return yaml.safe_load(text)


def test_yaml_shape_and_schema(tmp_path: Path) -> None:
    from ray.serve.schema import ServeDeploySchema

    doc = _config_yaml(
        tmp_path,
        "--min-replicas", "1",
        "--max-replicas", "4",
        "--api-key", "sk-unique-7781",
        "--stream-interval-ms", "20",
        "--no-engine-process",
    )  # fmt: skip
    ServeDeploySchema.model_validate(doc)  # what `serve deploy` checks
    assert doc["http_options"] == {"host": "0.0.0.0", "port": 8000}
    assert doc["grpc_options"]["port"] == 9000
    app, liveness = doc["applications"]
    assert (app["name"], app["route_prefix"], app["import_path"]) == (
        "kvray",
        "/",
        "cluster.app:build_app",
    )
    # GET /health goes to a replica of its own (the longest route prefix wins).
    assert liveness == {
        "name": "kvray-liveness",
        "route_prefix": "/health",
        "import_path": "cluster.app:build_liveness_app",
    }
    assert app["args"]["min_replicas"] == 1 and app["args"]["max_replicas"] == 4
    assert "sk-unique-7781" not in yaml.safe_dump(doc)  # the key itself is never written
    assert app["args"]["api_key_env"] == "KVRAY_API_KEY"
    assert app["args"]["stream_interval_ms"] == 20
    assert app["args"]["engine_process"] is False


@pytest.fixture(scope="module")
def yaml_app(serve_ports: ServePorts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    """Deploys the generated YAML the way `serve deploy` would: schema, import path, args."""
    from ray import serve
    from ray._common.utils import import_attr
    from ray.serve.schema import ServeDeploySchema

    doc = _config_yaml(
        tmp_path_factory.mktemp("yaml"),
        "--host", "127.0.0.1",
        "--port", str(serve_ports.http),
        "--grpc-port", str(serve_ports.grpc),
        "--max-queued-requests", "1",
        "--max-num-seqs", "1",
        "--kv-cache-memory", str(KV_CACHE_BYTES),
    )  # fmt: skip
    schema = ServeDeploySchema.model_validate(doc)
    # Every application of the YAML, each moved below /yaml (the session's main app keeps
    # its own prefix): kvray on /yaml, its liveness application on /yaml/health.
    names = []
    for spec in schema.applications:
        name = spec.name.replace("kvray", "kvray-yaml", 1)
        builder = import_attr(spec.import_path)
        route = "/yaml" + spec.route_prefix.rstrip("/")
        serve.run(builder(spec.args), name=name, route_prefix=route)
        names.append(name)
    base = f"http://127.0.0.1:{serve_ports.http}/yaml"
    yield App(names[0], base, "kvray-demo", None)
    for name in names:
        serve.delete(name)


@pytest.mark.slow
def test_generated_yaml_deploys_and_answers(yaml_app: App) -> None:
    r = openai_client(yaml_app).completions.create(
        model="kvray-demo", prompt="Once upon a time", max_tokens=4
    )
    assert r.usage.completion_tokens >= 1 and r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.slow
def test_flood_gets_429_with_retry_after_and_health_stays_up(yaml_app: App) -> None:
    body = {
        "model": "kvray-demo",
        "prompt": "Tell me a story",
        "max_tokens": 48,
        "ignore_eos": True,
    }

    async def flood() -> tuple[list[httpx.Response], list[int]]:
        async with httpx.AsyncClient(timeout=300) as http:
            posts = [
                asyncio.create_task(http.post(f"{yaml_app.base_url}/v1/completions", json=body))
                for _ in range(16)
            ]
            health = []
            while not all(p.done() for p in posts):
                health.append((await http.get(f"{yaml_app.base_url}/health")).status_code)
                await asyncio.sleep(0.05)
            return [p.result() for p in posts], health

    responses, health = asyncio.run(flood())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(200) >= 1 and codes.count(429) >= 1, codes
    for r in responses:
        if r.status_code == 429:
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_exceeded"
    assert health and set(health) == {200}


@pytest.mark.slow
def test_health_answers_while_the_http_ingress_cannot(yaml_app: App) -> None:
    """The liveness probe does not go through the HTTP ingress: with the ingress replica's
    process stopped (SIGSTOP: as stuck as a loop can be), GET /health still answers 200 from
    the liveness application, while any other path gets no answer from the ingress."""
    title = f"ray::ServeReplica:{yaml_app.name}:OpenAIIngress".encode()
    (ingress,) = pids_matching(lambda cmd: cmd.startswith(title))
    with httpx.Client(timeout=10) as http:
        assert http.get(f"{yaml_app.base_url}/health").json() == {"status": "ok"}
        os.kill(ingress, signal.SIGSTOP)
        try:
            # A stopped process cannot answer: the request either hangs or, once the proxy's
            # health check has marked the replica down, gets the proxy's own 5xx.
            try:
                stuck = http.get(f"{yaml_app.base_url}/v1/models", timeout=2)
            except httpx.TimeoutException:
                pass
            else:
                assert stuck.status_code >= 500, stuck.text
            health = http.get(f"{yaml_app.base_url}/health")
            assert (health.status_code, health.json()) == (200, {"status": "ok"})
            assert http.head(f"{yaml_app.base_url}/health").status_code == 200
            wrong = http.post(f"{yaml_app.base_url}/health")
            assert wrong.status_code == 405 and wrong.json()["error"]["code"] == 405
            below = http.get(f"{yaml_app.base_url}/health/deep")
            assert below.status_code == 404 and "error" in below.json()
        finally:
            os.kill(ingress, signal.SIGCONT)
        # The ingress answers again once it runs.
        assert http.get(f"{yaml_app.base_url}/v1/models").status_code == 200

"""`kvray config` writes a Serve config that validates, deploys and answers; the deployed app
(1 replica, tiny queue) also shows admission control: 429 + Retry-After under a flood while
/health stays 200."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from cluster.cli import config as config_cmd
from tests.cluster.serve_helpers import KV_CACHE_BYTES, App, ServePorts, openai_client


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
    (app,) = doc["applications"]
    assert (app["name"], app["route_prefix"], app["import_path"]) == (
        "kvray",
        "/",
        "cluster.app:build_app",
    )
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
    (spec,) = schema.applications
    builder = import_attr(spec.import_path)
    name, prefix = "kvray-yaml", "/yaml"  # the session's main app keeps its own prefix
    serve.run(builder(spec.args), name=name, route_prefix=prefix)
    base = f"http://127.0.0.1:{serve_ports.http}{prefix}"
    yield App(name, base, "kvray-demo", None)
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

"""Through a real Ray cluster: an engine replica with engine_metrics_port serves the vLLM-named
gauges on it, and a request carrying an inference gateway's destination header is served."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.config import ServeConfig
from tests.cluster.serve_helpers import (
    KV_CACHE_BYTES,
    App,
    ServePorts,
    deploy,
    free_port,
    wait_for,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def metrics_port(serve_ports: ServePorts) -> int:
    """Picked once Ray and Serve run, just before the app binds it: a port picked at import
    (collection) was sometimes taken by one of the processes started in between (a 404)."""
    return free_port()


@pytest.fixture(scope="module")
def gateway_app(serve_ports: ServePorts, metrics_port: int) -> Iterator[App]:
    from ray import serve

    config = ServeConfig.from_flat(
        num_replicas=1, kv_cache_memory_bytes=KV_CACHE_BYTES, engine_metrics_port=metrics_port
    )
    app = deploy("kvray-gateway", "/gateway", config, serve_ports, None)
    yield app
    serve.delete(app.name)


def _scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_a_gateway_request_is_served_and_the_gauges_are_scraped(
    gateway_app: App, metrics_port: int
) -> None:
    import ray

    node_ip = ray.util.get_node_ip_address()
    body = {"model": gateway_app.model, "prompt": "hello there", "max_tokens": 4}
    resp = httpx.post(
        f"{gateway_app.base_url}/v1/completions",
        json=body,
        headers={"x-gateway-destination-endpoint": f"{node_ip}:8000"},
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 4

    wait_for(lambda: "vllm:num_requests_running" in _scrape(metrics_port), "the metrics endpoint")
    metrics = _scrape(metrics_port)
    for name in (
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:lora_requests_info",
        "vllm:cache_config_info",
    ):
        ((labels, value),) = metrics[name]
        assert labels["model_name"] == gateway_app.model, name
    ((labels, blocks),) = metrics["vllm:cache_config_info"]
    assert int(labels["num_gpu_blocks"]) > 0 and int(labels["block_size"]) > 0
    assert 0.0 <= metrics["vllm:kv_cache_usage_perc"][0][1] <= 1.0

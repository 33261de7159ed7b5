"""The vLLM-named gauges an engine replica serves for inference gateways' endpoint pickers:
scraped over a real socket and read with prometheus_client's own parser (no Ray)."""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.config import ServeConfig
from cluster.replica.gateway_metrics import GatewayMetrics, gateway_metrics
from workers.core.stats import EngineStats
from workers.lora.request import LoRARequest

NOW = 1_700_000_000.0


class Engine:
    """What the replica reads: the engine's last stats, and its own queue count."""

    def __init__(self) -> None:
        self.stats = EngineStats()
        self.queued = 0


@pytest.fixture
def engine() -> Engine:
    return Engine()


@pytest.fixture
def served(engine: Engine) -> Iterator[GatewayMetrics]:
    m = GatewayMetrics(
        "demo", 16, lambda: engine.stats, lambda: engine.queued, max_loras=4, clock=lambda: NOW
    )
    assert m.serve(0, addr="127.0.0.1")  # a free port
    yield m
    m.close()


def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Metric name -> its samples (labels, value), as the endpoint picker reads them."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def one(metrics: dict, name: str) -> tuple[dict[str, str], float]:
    (sample,) = metrics[name]
    return sample


def test_the_protocol_gauges_follow_the_engine_at_each_scrape(
    engine: Engine, served: GatewayMetrics
) -> None:
    assert served.port
    first = scrape(served.port)
    assert set(first) == {
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:lora_requests_info",
        "vllm:cache_config_info",
    }
    assert one(first, "vllm:num_requests_running") == ({"model_name": "demo"}, 0.0)
    # Read at the scrape, not pushed: a change shows on the next one.
    engine.stats = EngineStats(
        num_requests_running=3, num_requests_waiting=2, kv_cache_usage=0.25, kv_blocks_total=512
    )
    m = scrape(served.port)
    assert one(m, "vllm:num_requests_running")[1] == 3
    assert one(m, "vllm:num_requests_waiting")[1] == 2
    assert one(m, "vllm:kv_cache_usage_perc") == ({"model_name": "demo"}, 0.25)
    labels, value = one(m, "vllm:cache_config_info")
    assert labels == {"model_name": "demo", "block_size": "16", "num_gpu_blocks": "512"}
    assert value == 1
    # Requests the replica holds before the engine sees them wait too.
    engine.queued = 7
    assert one(scrape(served.port), "vllm:num_requests_waiting")[1] == 7


def test_lora_info_names_loaded_and_awaited_adapters(
    engine: Engine, served: GatewayMetrics
) -> None:
    labels, value = one(scrape(served.port), "vllm:lora_requests_info")
    assert labels == {
        "model_name": "demo",
        "max_lora": "4",
        "running_lora_adapters": "",
        "waiting_lora_adapters": "",
    }
    assert value == NOW  # vLLM's value: when it was read, so the picker takes the latest
    served.track("a", LoRARequest("sql", 11, "/adapters/sql"))
    served.track("b", LoRARequest("chat", 12, "/adapters/chat"))
    served.track("c", None)  # a base-model request
    engine.stats = EngineStats(lora_adapters=(11,), lora_slots_used=1, lora_slots_total=4)
    labels, _ = one(scrape(served.port), "vllm:lora_requests_info")
    assert (labels["running_lora_adapters"], labels["waiting_lora_adapters"]) == ("sql", "chat")
    # `chat` loaded and `sql`'s request gone: still loaded, so still running.
    served.untrack("a")
    served.untrack("b")
    engine.stats = EngineStats(lora_adapters=(11, 12))
    labels, _ = one(scrape(served.port), "vllm:lora_requests_info")
    assert (labels["running_lora_adapters"], labels["waiting_lora_adapters"]) == ("chat,sql", "")


def test_kv_usage_stays_a_fraction(engine: Engine, served: GatewayMetrics) -> None:
    engine.stats = EngineStats(kv_cache_usage=1.5)
    assert one(scrape(served.port), "vllm:kv_cache_usage_perc")[1] == 1.0


def test_a_taken_port_is_a_warning_not_a_failure(
    engine: Engine, served: GatewayMetrics, caplog: pytest.LogCaptureFixture
) -> None:
    second = GatewayMetrics("demo", 16, lambda: engine.stats)
    assert served.port
    with caplog.at_level("WARNING", logger="ray.serve.kvray.gateway_metrics"):
        assert not second.serve(served.port, addr="127.0.0.1")
    assert second.port is None
    assert "keeps serving requests" in caplog.text
    second.track("r", LoRARequest("sql", 11, "/a"))  # unserved: tracks nothing
    assert not second._requests
    scrape(served.port)  # the first one serves on


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_setting_turns_it_on(engine: Engine) -> None:
    assert ServeConfig().network.engine_metrics_port == 0
    off = gateway_metrics(ServeConfig(), lambda: engine.stats, lambda: 0)
    assert off.port is None
    port = _free_port()
    config = ServeConfig.from_args({"engine_metrics_port": port, "enable_lora": True})
    on = gateway_metrics(config, lambda: engine.stats, lambda: 0)
    try:
        assert on.port == port
        labels, _ = one(scrape(port), "vllm:lora_requests_info")
        assert labels["max_lora"] == str(config.lora.max_loras)
        assert labels["model_name"] == config.engine.model_name()
    finally:
        on.close()
    for bad in (-1, 65536, "8001", True):
        with pytest.raises(ValueError, match="^engine_metrics_port "):
            ServeConfig.from_args({"engine_metrics_port": bad})

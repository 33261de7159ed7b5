"""An engine replica's load under vLLM's metric names, for Kubernetes inference gateways.

The Gateway API Inference Extension's endpoint picker (and the schedulers built on it, such
as llm-d's) chooses a model-server pod per request from gauges it scrapes from every pod of
its InferencePool at GET /metrics, under the names vLLM gives them (the extension's model
server protocol). With `engine_metrics_port` set, each engine replica serves them on that port:

    vllm:num_requests_waiting    gauge  requests here that the engine is not running yet
    vllm:num_requests_running    gauge  requests the engine runs
    vllm:kv_cache_usage_perc     gauge  used / total KV blocks, 0..1
    vllm:lora_requests_info      gauge  the time of the scrape; labels running_lora_adapters
                                        (adapters in the engine's device slots),
                                        waiting_lora_adapters (adapters of requests here whose
                                        adapter is in no slot yet), max_lora (device slots; 0:
                                        LoRA off)
    vllm:cache_config_info       gauge  1; labels block_size, num_gpu_blocks

each with the label `model_name` (the served model), as vLLM labels them. The values are read
when scraped (a custom collector on a registry of its own, never the process-wide one), from
the engine's last stats and the replica's own count of what waits: nothing runs between
scrapes. kvray's own metrics (kvray_*, through Ray's exporter) are unaffected.

One pod (one Ray node) is one model server to the picker: the first replica on a node that
binds the port serves it; another one there logs a warning and keeps serving requests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily

if TYPE_CHECKING:
    from cluster.config import ServeConfig
    from workers.core.stats import EngineStats
    from workers.lora.request import LoRARequest

logger = logging.getLogger("ray.serve.kvray.gateway_metrics")

BIND_ADDRESS = "0.0.0.0"  # the picker scrapes the pod's IP


class GatewayMetrics:
    """The vLLM-named gauges of one replica (module doc) and, once `serve`d, their endpoint.

    `stats` gives the engine's last EngineStats; `waiting` the replica's count of requests it
    holds that the engine does not run (None: the engine's waiting count alone). `max_loras`:
    the engine's adapter slots, 0 without LoRA. `track` / `untrack` keep the adapters of the
    requests in flight, which the engine's stats give only as ids in its slots.
    """

    def __init__(
        self,
        model_name: str,
        block_size: int,
        stats: Callable[[], EngineStats],
        waiting: Callable[[], int] | None = None,
        max_loras: int = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._model = model_name
        self._block_size = block_size
        self._stats = stats
        self._waiting = waiting
        self._max_loras = max_loras
        self._clock = clock
        # request id -> its adapter's (id, name); adapter id -> name, for those in a slot.
        self._requests: dict[str, tuple[int, str]] = {}
        self._names: dict[int, str] = {}
        self._server: Any = None

    # -- the requests' adapters (the replica's generate) -----------------------------------

    def track(self, request_id: str, lora: LoRARequest | None) -> None:
        if lora is not None and self._server is not None:
            self._requests[request_id] = (lora.lora_int_id, lora.lora_name)
            self._names[lora.lora_int_id] = lora.lora_name

    def untrack(self, request_id: str) -> None:
        if self._requests:
            self._requests.pop(request_id, None)

    # -- the endpoint ------------------------------------------------------------------------

    def serve(self, port: int, addr: str = BIND_ADDRESS) -> bool:
        """Serves GET /metrics on `port` (0: a free one, see `port`); False, logged at warning,
        when it cannot bind (another replica on this node holds it)."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)  # type: ignore[arg-type]
        try:
            self._server, _ = start_http_server(port, addr=addr, registry=registry)
        except OSError as err:
            logger.warning(
                "engine metrics port %d not served by this replica (%s): another replica on "
                "this node serves the gateway metrics; this one keeps serving requests",
                port,
                err,
            )
            return False
        logger.info("gateway metrics (vllm:*) at http://%s:%d/metrics", addr, self.port)
        return True

    @property
    def port(self) -> int | None:
        """The port served on; None when not serving."""
        return None if self._server is None else int(self._server.server_port)

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    # -- the collector (called on the HTTP server's thread, per scrape) ---------------------

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self._stats()
        waiting = s.num_requests_waiting
        if self._waiting is not None:
            waiting = max(waiting, self._waiting())
        model = ("model_name",)
        yield _gauge(
            "vllm:num_requests_waiting",
            "Requests waiting to be processed.",
            model,
            [self._model],
            waiting,
        )
        yield _gauge(
            "vllm:num_requests_running",
            "Requests the engine is running.",
            model,
            [self._model],
            s.num_requests_running,
        )
        yield _gauge(
            "vllm:kv_cache_usage_perc",
            "Fraction of the KV cache's blocks in use (0 to 1).",
            model,
            [self._model],
            min(1.0, max(0.0, float(s.kv_cache_usage))),
        )
        running, adapters_waiting = self._adapters(s)
        yield _gauge(
            "vllm:lora_requests_info",
            "LoRA adapters loaded and waiting; the value is the time of this reading.",
            ("model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"),
            [self._model, str(self._max_loras), ",".join(running), ",".join(adapters_waiting)],
            self._clock(),
        )
        yield _gauge(
            "vllm:cache_config_info",
            "The KV cache's configuration.",
            ("model_name", "block_size", "num_gpu_blocks"),
            [self._model, str(self._block_size), str(s.kv_blocks_total)],
            1.0,
        )

    def _adapters(self, s: EngineStats) -> tuple[list[str], list[str]]:
        """Names of the adapters in the engine's slots, and of those requests here wait for."""
        in_slots = set(s.lora_adapters)
        requests = list(self._requests.values())  # one C-level copy: the loop thread edits it
        names = dict(self._names)
        # Forget the names of adapters neither loaded nor asked for: bounded by slots + requests.
        keep = in_slots | {i for i, _ in requests}
        for i in set(names) - keep:
            self._names.pop(i, None)
        running = sorted(names[i] for i in in_slots if i in names)
        waiting = sorted({name for i, name in requests if i not in in_slots})
        return running, waiting


def _gauge(
    name: str, doc: str, labels: tuple[str, ...], values: list[str], value: float
) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=list(labels))
    g.add_metric(values, value)
    return g


def gateway_metrics(
    config: ServeConfig, stats: Callable[[], EngineStats], waiting: Callable[[], int]
) -> GatewayMetrics:
    """A replica's gateway metrics, served on `engine_metrics_port` when it is set; unserved
    (tracking nothing) when it is 0 or taken."""
    lora = config.lora
    metrics = GatewayMetrics(
        config.engine.model_name(),
        config.engine.block_size,
        stats,
        waiting,
        max_loras=lora.max_loras if lora.enabled else 0,
    )
    if config.network.engine_metrics_port:
        metrics.serve(config.network.engine_metrics_port)
    return metrics

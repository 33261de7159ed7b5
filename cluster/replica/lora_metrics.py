"""Prometheus metrics of an engine replica's LoRA adapters (part of EngineMetrics, metrics.py).

Per adapter (label `lora`): requests that ended here, their prompt and generated tokens and
their time to first token. Base-model requests are counted with `lora=""`, so one query shows
the base model next to its adapters. The label's values are bounded per replica: the first
`MAX_LORA_LABELS` adapter names a replica sees keep their own value, later ones are counted
as `other` (a deployment that loads adapters at runtime could otherwise grow series without
end).

Per replica: the engine's device slots in use and in all (gauges), adapters loaded into a slot
and loads that evicted another (counters), and the seconds the loads took (a counter of
seconds: `rate(seconds) / rate(loads)` is the mean load time), all from EngineStats' `lora_*`
fields, advanced by their difference as EngineMetrics does for its counters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cluster.ray_internals import record_zero
from cluster.replica.cumulative import CumulativeCounters

if TYPE_CHECKING:
    from workers.core.stats import EngineStats
    from workers.lora.request import LoRARequest
    from workers.outputs import RequestOutput

MAX_LORA_LABELS = 16
BASE_LABEL = ""  # a base-model request
OTHER_LABEL = "other"  # adapters past the first MAX_LORA_LABELS a replica saw


class LoraLabels:
    """The `lora` label value of a request: bounded (module doc)."""

    def __init__(self, limit: int = MAX_LORA_LABELS) -> None:
        self._limit = limit
        self._named: set[str] = set()

    def __call__(self, lora: LoRARequest | None) -> str:
        if lora is None:
            return BASE_LABEL
        name = lora.lora_name
        if name in self._named:
            return name
        if len(self._named) < self._limit:
            self._named.add(name)
            return name
        return OTHER_LABEL


class LoraMetrics:
    """Made by EngineMetrics with its metric constructors, so the series carry the same
    `model` and `replica` labels; `ttft_buckets`: the engine's TTFT boundaries."""

    def __init__(
        self, tags: dict[str, str], counter: Any, gauge: Any, histogram: Any, ttft_buckets: Any
    ) -> None:
        self._labels = LoraLabels()
        lora = ("lora",)
        self._requests = counter(
            "kvray_lora_requests_total", "Requests that ended, by LoRA adapter.", lora
        )
        self._prompt_tokens = counter(
            "kvray_lora_prompt_tokens_total",
            "Prompt tokens of finished requests, by adapter.",
            lora,
        )
        self._generation_tokens = counter(
            "kvray_lora_generation_tokens_total",
            "Generated tokens of finished requests, by adapter.",
            lora,
        )
        self._ttft = histogram(
            "kvray_lora_time_to_first_token_seconds",
            "Arrival to first generated token, by adapter.",
            ttft_buckets,
            lora,
        )
        self._slots_used = gauge("kvray_lora_slots_used", "Adapter slots on the device in use.")
        self._slots_total = gauge("kvray_lora_slots", "Adapter slots on the device (capacity).")
        self._loads = counter("kvray_lora_loads_total", "Adapters loaded into a device slot.")
        self._evictions = counter(
            "kvray_lora_evictions_total", "Adapter loads that evicted another adapter."
        )
        self._load_seconds = counter(
            "kvray_lora_load_seconds_total", "Seconds spent loading adapters into slots."
        )
        base = {**tags, "lora": BASE_LABEL}
        for c in (self._requests, self._prompt_tokens, self._generation_tokens):
            record_zero(c, base)
        for c in (self._loads, self._evictions, self._load_seconds):
            record_zero(c, tags)
        self._cumulative = CumulativeCounters()  # the lora_* counts' previous snapshot

    def observe_stats(self, stats: EngineStats) -> None:
        self._slots_used.set(int(stats.lora_slots_used))
        self._slots_total.set(int(stats.lora_slots_total))
        advance = self._cumulative.advance
        advance(self._loads, "loads", stats.lora_loads)
        advance(self._evictions, "evictions", stats.lora_evictions)
        advance(self._load_seconds, "load_seconds", stats.lora_load_seconds)

    def observe_finished(
        self, out: RequestOutput, lora: LoRARequest | None, prompt_tokens: int, gen_tokens: int
    ) -> None:
        tags = {"lora": self._labels(lora)}
        self._requests.inc(tags=tags)
        if prompt_tokens:
            self._prompt_tokens.inc(prompt_tokens, tags=tags)
        if gen_tokens:
            self._generation_tokens.inc(gen_tokens, tags=tags)
        m = out.metrics
        if m is not None and m.first_token_time is not None:
            self._ttft.observe(max(0.0, m.first_token_time - m.arrival_time), tags=tags)

    def observe_aborted(self, lora: LoRARequest | None) -> None:
        self._requests.inc(tags={"lora": self._labels(lora)})

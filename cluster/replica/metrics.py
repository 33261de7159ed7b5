"""Prometheus metrics of an engine replica, exported through Ray's metrics agent (the ingresses'
and the router's are in cluster/routing/metrics.py).

`ray.util.metrics` records into the Ray core worker of the calling process; each node's
metrics agent serves every process's series on the node's metrics export port (8080 by
default) with a `ray_` prefix. One scrape per node therefore covers every replica on it,
which is how KubeRay's Prometheus set-up finds Ray Serve's own metrics too. Names, types and
labels are monitoring/README.md's; counters are declared with their `_total` suffix, which Ray's
exporter keeps as is (it appends `_total` only to counters that lack it), so
`kvray_prompt_tokens_total` is scraped as `ray_kvray_prompt_tokens_total`.

Caveat of Ray's exporter worth knowing when reading the data: bucket counts and `_count` of
a histogram are exact, but `_sum` is rebuilt from bucket midpoints, so means computed from
`_sum / _count` are approximate. The exact token totals are the counters.

`ray` is imported inside the constructors: this module sits under `kvray --help`'s imports.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from cluster.ray_internals import record_zero
from cluster.replica.cumulative import CumulativeCounters
from cluster.replica.kv_offload_metrics import KvOffloadMetrics
from cluster.replica.kv_share_metrics import KvShareMetrics
from cluster.replica.lora_metrics import LoraMetrics
from cluster.replica.moe_metrics import MoeMetrics
from cluster.replica.spec_decode_metrics import SpecDecodeMetrics
from workers.core.stats import new_compile_seconds

if TYPE_CHECKING:
    from workers.core.stats import EngineStats
    from workers.lora.request import LoRARequest
    from workers.outputs import RequestOutput

ENGINE_TAG_KEYS = ("model", "replica")
ENGINE_INFO_TAG_KEYS = (*ENGINE_TAG_KEYS, "cpu_kernels")

# Time to first token: a cached short prompt answers in milliseconds, a long prompt behind a
# full queue can take minutes.
TTFT_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
    0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip
# Inter-token latency: sub-millisecond for a tiny model on a GPU, seconds when a step carries
# a large chunked prefill or the replica is swapping preempted requests back in.
ITL_BUCKETS_S: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03,
    0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
# End-to-end latency and queue time: up to an hour-long generation.
E2E_BUCKETS_S: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0,
    90.0, 120.0, 180.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0,
)  # fmt: skip
QUEUE_BUCKETS_S: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip
# Token counts per request, 1-2-5 steps up to a million-token context. Boundaries are per
# metric name across the whole cluster, so they cannot follow one model's max_model_len.
REQUEST_TOKEN_BUCKETS: tuple[float, ...] = tuple(
    float(m * 10**e) for e in range(6) for m in (1, 2, 5)
) + (1_000_000.0,)
# Tokens per engine step: token budgets are usually powers of two.
ITERATION_TOKEN_BUCKETS: tuple[float, ...] = tuple(float(2**i) for i in range(18))
# Grammar compiles (structured outputs): under a millisecond for a regex, seconds for a large
# schema; grammar_timeout_s (30 s by default) ends the wait.
GRAMMAR_COMPILE_BUCKETS_S: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip

FINISH_REASONS = ("stop", "length", "abort")


class EngineMetrics:
    """Metrics of one engine replica, labelled `model` and `replica`."""

    def __init__(self, model: str, replica: str) -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        tags = {"model": model, "replica": replica}

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return Counter(name, doc, tag_keys=ENGINE_TAG_KEYS + extra).set_default_tags(tags)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, tag_keys=ENGINE_TAG_KEYS).set_default_tags(tags)

        def histogram(
            name: str, doc: str, buckets: Sequence[float], extra: tuple[str, ...] = ()
        ) -> Any:
            return Histogram(
                name, doc, boundaries=list(buckets), tag_keys=ENGINE_TAG_KEYS + extra
            ).set_default_tags(tags)

        self._running = gauge("kvray_num_requests_running", "Requests in the running batch.")
        self._waiting = gauge("kvray_num_requests_waiting", "Requests waiting to be scheduled.")
        self._kv_usage = gauge(
            "kvray_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0-1)."
        )
        self._kv_blocks = gauge("kvray_kv_cache_blocks", "KV-cache capacity in blocks.")
        # Info-style: 1 for the replica's engine, what it runs in the labels.
        self._info = Gauge(
            "kvray_engine_info",
            "1 per engine replica; labels: what it runs (cpu_kernels: on (AMX|AVX-512|AVX2) "
            "or off: <reason>).",
            tag_keys=ENGINE_INFO_TAG_KEYS,
        ).set_default_tags(tags)
        self._info_tags: dict[str, str] | None = None

        self._preemptions = counter("kvray_num_preemptions_total", "Requests preempted.")
        self._prefix_queries = counter(
            "kvray_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache."
        )
        self._prefix_hits = counter(
            "kvray_prefix_cache_hits_total", "Prompt tokens found in the prefix cache."
        )
        self._prompt_tokens = counter(
            "kvray_prompt_tokens_total", "Prompt tokens of finished requests."
        )
        self._generation_tokens = counter(
            "kvray_generation_tokens_total", "Generated tokens of finished requests."
        )
        self._success = counter(
            "kvray_request_success_total",
            "Finished requests by finish reason.",
            extra=("finish_reason",),
        )

        self._ttft = histogram(
            "kvray_time_to_first_token_seconds",
            "Arrival to first generated token.",
            TTFT_BUCKETS_S,
        )
        self._itl = histogram(
            "kvray_inter_token_latency_seconds",
            "Time between consecutive generated tokens.",
            ITL_BUCKETS_S,
        )
        self._e2e = histogram(
            "kvray_e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS_S
        )
        self._queue = histogram(
            "kvray_request_queue_time_seconds", "Arrival to first scheduled.", QUEUE_BUCKETS_S
        )
        self._req_prompt = histogram(
            "kvray_request_prompt_tokens", "Prompt tokens per request.", REQUEST_TOKEN_BUCKETS
        )
        self._req_generation = histogram(
            "kvray_request_generation_tokens",
            "Generated tokens per request (all n samples).",
            REQUEST_TOKEN_BUCKETS,
        )
        self._iteration = histogram(
            "kvray_iteration_tokens", "Tokens processed per engine step.", ITERATION_TOKEN_BUCKETS
        )
        # Structured outputs (constrained decoding): the counters are created at 0 below.
        self._structured = counter(
            "kvray_structured_requests_total", "Requests with structured_outputs."
        )
        self._grammar_hits = counter(
            "kvray_grammar_cache_hits_total", "Structured requests whose grammar was cached."
        )
        self._grammar_compile = histogram(
            "kvray_grammar_compile_seconds",
            "Seconds to compile one grammar.",
            GRAMMAR_COMPILE_BUCKETS_S,
        )

        # Per adapter, and the adapters' device slots (cluster/replica/lora_metrics.py).
        self.lora = LoraMetrics(tags, counter, gauge, histogram, TTFT_BUCKETS_S)
        # Mixture-of-experts models: tokens per expert (cluster/replica/moe_metrics.py).
        self.moe = MoeMetrics(tags, counter, gauge)
        # The host KV tier (cluster/replica/kv_offload_metrics.py).
        self.kv_offload = KvOffloadMetrics(tags, counter, gauge)
        # Speculative decoding (cluster/replica/spec_decode_metrics.py).
        self.spec_decode = SpecDecodeMetrics(tags, counter)
        # The cluster KV tier (cluster/replica/kv_share_metrics.py).
        self.kv_share = KvShareMetrics(tags, counter, histogram)

        for c in (
            self._preemptions,
            self._prefix_queries,
            self._prefix_hits,
            self._prompt_tokens,
            self._generation_tokens,
            self._structured,
            self._grammar_hits,
        ):
            record_zero(c, tags)
        for reason in FINISH_REASONS:
            record_zero(self._success, {**tags, "finish_reason": reason})

        # Cumulative engine counters seen at the previous observe_stats(); the exported
        # counters advance by the difference (cluster/replica/cumulative.py).
        self._cumulative = CumulativeCounters()
        self._advance = self._cumulative.advance

    def observe_stats(self, stats: EngineStats) -> None:
        """Publish a stats snapshot. Call it periodically, idle or not, so gauges fall to 0."""
        self._running.set(int(stats.num_requests_running))
        self._waiting.set(int(stats.num_requests_waiting))
        self._kv_usage.set(float(stats.kv_cache_usage))
        self._kv_blocks.set(int(stats.kv_blocks_total))
        self._observe_info(stats)
        self.lora.observe_stats(stats)
        self.moe.observe(stats.moe_expert_tokens)
        self.kv_offload.observe(stats)
        self.spec_decode.observe(stats)
        self._advance(self._preemptions, "num_preemptions", int(stats.num_preemptions))
        self._advance(self._prefix_queries, "prefix_cache_queries", int(stats.prefix_cache_queries))
        self._advance(self._prefix_hits, "prefix_cache_hits", int(stats.prefix_cache_hits))
        self._advance(self._structured, "structured_requests", int(stats.structured_requests))
        self._advance(self._grammar_hits, "grammar_cache_hits", int(stats.grammar_cache_hits))
        seen = int(self._cumulative.last.get("grammar_compiles", 0))
        for seconds in new_compile_seconds(stats, seen):
            self._grammar_compile.observe(seconds)
        self._cumulative.last["grammar_compiles"] = int(stats.grammar_compiles)

    def _observe_info(self, stats: EngineStats) -> None:
        """`kvray_engine_info` = 1 with the engine's labels; a rebuilt engine that runs
        otherwise moves the 1 to its new labels (the old series drops to 0). Set on every
        snapshot, like the other gauges: Ray's metrics agent drops a gauge series that has
        not been reported for two export intervals."""
        tags = {"cpu_kernels": stats.cpu_kernels or "unknown"}
        if self._info_tags is not None and tags != self._info_tags:
            self._info.set(0, tags=self._info_tags)
        self._info.set(1, tags=tags)
        self._info_tags = tags

    def observe_finished(self, out: RequestOutput, lora: LoRARequest | None = None) -> None:
        """Account one finished request (the last RequestOutput, `finished=True`) that ran
        under adapter `lora` (None: the base model).

        Token counts come from the same fields the API's `usage` is built from
        (`prompt_token_ids`, each sample's `token_ids`) so the counters equal its sums.
        """
        m = out.metrics
        prompt_tokens = len(out.prompt_token_ids)
        if not prompt_tokens and m is not None:
            prompt_tokens = m.num_prompt_tokens
        generation_tokens = sum(len(c.token_ids) for c in out.outputs)

        if prompt_tokens:
            self._prompt_tokens.inc(prompt_tokens)
        if generation_tokens:
            self._generation_tokens.inc(generation_tokens)
        self._success.inc(tags={"finish_reason": _request_finish_reason(out)})
        self._req_prompt.observe(prompt_tokens)
        self._req_generation.observe(generation_tokens)
        self.lora.observe_finished(out, lora, prompt_tokens, generation_tokens)

        if m is None:
            return
        if m.first_scheduled_time is not None:
            self._queue.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        if m.first_token_time is not None:
            self._ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
        if m.finished_time is not None:
            self._e2e.observe(max(0.0, m.finished_time - m.arrival_time))
        times = m.token_times
        for prev, cur in zip(times, times[1:], strict=False):
            self._itl.observe(max(0.0, cur - prev))

    def observe_aborted(self, lora: LoRARequest | None = None) -> None:
        """Account a request that ended without a final output (client gone, cancelled)."""
        self._success.inc(tags={"finish_reason": "abort"})
        self.lora.observe_aborted(lora)

    def observe_step_tokens(self, counts: list[int]) -> None:
        """Tokens of each engine step since the last call (`engine.pop_step_token_counts()`)."""
        for n in counts:
            self._iteration.observe(n)


def _request_finish_reason(out: RequestOutput) -> str:
    """One reason per request: the most telling one among its n samples."""
    reasons = {c.finish_reason for c in out.outputs}
    if getattr(out, "error", None) or "abort" in reasons or None in reasons:
        return "abort"
    if "length" in reasons:
        return "length"
    return "stop"

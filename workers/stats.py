"""A snapshot of engine state for metrics and routing."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # tokens looked up (cumulative)
    prefix_cache_hits: int = 0  # tokens found (cumulative)
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_steps: int = 0

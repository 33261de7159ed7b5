"""`LLMEngine.stats()`: the snapshot of an engine's state (workers/core/stats.py EngineStats)."""

from __future__ import annotations

from typing import Any

from workers.core.stats import EngineStats, waiting_prefill_tokens

# The engine is passed in (workers.core.engine.LLMEngine), not imported: no import cycle.


def engine_stats(engine: Any) -> EngineStats:
    bm, sched = engine.block_manager, engine.scheduler
    g = engine.structured.compiler.stats()
    return EngineStats(
        num_requests_running=len(sched.running),
        num_requests_waiting=len(sched.waiting),
        num_waiting_prefill_tokens=waiting_prefill_tokens(sched.waiting, sched.running),
        kv_blocks_used=bm.num_used_blocks,
        kv_blocks_total=bm.num_blocks,
        kv_cache_usage=bm.usage,
        prefix_cache_queries=bm.prefix_queries,
        prefix_cache_hits=bm.prefix_hits,
        num_preemptions=sched.num_preemptions,
        prompt_tokens=engine.prompt_tokens,
        generation_tokens=engine.generation_tokens,
        num_steps=engine.num_steps,
        structured_requests=g.structured_requests,
        grammar_cache_hits=g.cache_hits,
        grammar_compiles=g.compiles,
        grammar_compile_seconds=g.compile_seconds,
        recent_grammar_compile_seconds=g.recent_compile_seconds,
        cpu_kernels=engine.worker_info.get("cpu_kernels", ""),
        moe_expert_tokens=engine.moe_expert_tokens,
        **_lora_stats(engine),
        **_offload_stats(bm.host_tier),
        **({} if engine.speculator is None else engine.speculator.stats()),
    )


def _offload_stats(tier: Any) -> dict[str, int]:
    """The host KV tier's fields (workers/core/host_tier.py HostTier; None: off)."""
    if tier is None:
        return {}
    return {
        "kv_offload_blocks": tier.num_blocks,
        "kv_offload_bytes": tier.num_bytes,
        "kv_offload_capacity_bytes": tier.capacity_bytes,
        "kv_offload_hit_tokens": tier.hit_tokens,
        "kv_offload_copies_out": tier.copies_out,
        "kv_offload_copies_in": tier.copies_in,
        "kv_offload_evictions": tier.evictions,
    }


def _lora_stats(engine: Any) -> dict[str, Any]:
    t = engine.lora_slots
    if t is None:
        return {}
    return {
        "lora_adapters": t.adapters(),
        "lora_slots_used": t.used,
        "lora_slots_total": t.config.max_loras,
        "lora_loads": t.loads,
        "lora_evictions": t.evictions,
        "lora_load_seconds": engine.lora_load_seconds,
    }

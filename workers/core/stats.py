"""A snapshot of engine state for metrics and routing."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class EngineStats:
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    # Tokens the engine still has to prefill before its waiting work runs: every token of the
    # waiting sequences (a preempted one recomputes its output too) plus what the running ones
    # have not prefilled yet (a long prompt is chunked over steps). Admission control counts
    # this, not requests: one 30k-token prompt is as much queued work as 200 short ones.
    num_waiting_prefill_tokens: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # tokens looked up (cumulative)
    prefix_cache_hits: int = 0  # tokens found (cumulative)
    num_preemptions: int = 0
    # The host KV tier (workers/core/host_tier.py; zeros when off): blocks and bytes it holds
    # (over all ranks' pools) and may hold; cumulative: prompt tokens restored from it instead
    # of computed (not in prefix_cache_hits), blocks copied out to it and back in, and blocks
    # dropped from it to make room.
    kv_offload_blocks: int = 0
    kv_offload_bytes: int = 0
    kv_offload_capacity_bytes: int = 0
    kv_offload_hit_tokens: int = 0
    kv_offload_copies_out: int = 0
    kv_offload_copies_in: int = 0
    kv_offload_evictions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_steps: int = 0
    # Speculative decoding (workers/core/speculator.py; zeros when off), cumulative, vLLM's
    # meanings: (sequence, step) pairs that verified a draft, draft tokens proposed, draft
    # tokens accepted, and per draft position the drafts whose token there was accepted.
    spec_decode_drafts: int = 0
    spec_decode_draft_tokens: int = 0
    spec_decode_accepted_tokens: int = 0
    spec_decode_accepted_per_position: tuple[int, ...] = ()
    # Constrained decoding (cumulative): requests with structured_outputs, those whose
    # grammar was already in the compile cache, compiles finished and their total seconds.
    structured_requests: int = 0
    grammar_cache_hits: int = 0
    grammar_compiles: int = 0
    grammar_compile_seconds: float = 0.0
    # Seconds of the latest compiles (at most RECENT_COMPILES, oldest first), the last one
    # being compile number `grammar_compiles`: a reader that remembers the count it saw
    # takes the new ones, for a histogram, without stats() having to be popped.
    recent_grammar_compile_seconds: tuple[float, ...] = ()
    # The CPU kernels' state, fixed at the worker's start: "on (AMX)", "on (AVX-512)",
    # "on (AVX2)" or "off: <reason>" (workers/device/layers/cpu_kernels/build.py KernelState);
    # "" where unknown (stats not from an engine yet).
    cpu_kernels: str = ""
    # LoRA (workers/lora/; zeros without it): the adapters in the device's slots now
    # (lora_int_id, most recently used last), the slots they fill and the slots there are,
    # and (cumulative) adapters loaded into a slot, loads that evicted an idle adapter, and
    # the seconds loading took (reading the file, or the host cache, and copying to the slot).
    lora_adapters: tuple[int, ...] = ()
    lora_slots_used: int = 0
    lora_slots_total: int = 0
    lora_loads: int = 0
    lora_evictions: int = 0
    lora_load_seconds: float = 0.0
    # Mixture-of-experts models: tokens routed to each expert (cumulative), one row per sparse
    # layer, one column per expert (a token counts once for each of its top-k experts); the
    # workers report them about once a second, so they may trail the other fields. () for
    # dense models.
    moe_expert_tokens: tuple[tuple[int, ...], ...] = ()


RECENT_COMPILES = 256


class _SeqState(Protocol):
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int: ...

    @property
    def prompt_len(self) -> int: ...


def waiting_prefill_tokens(waiting: Iterable[_SeqState], running: Iterable[_SeqState]) -> int:
    """EngineStats.num_waiting_prefill_tokens of a scheduler's queues."""
    queued = sum(seq.num_tokens - seq.num_computed_tokens for seq in waiting)
    return queued + sum(max(0, seq.prompt_len - seq.num_computed_tokens) for seq in running)


def new_compile_seconds(stats: EngineStats, seen_compiles: int) -> list[float]:
    """Compile durations in `stats` after the first `seen_compiles` compiles (those still
    listed: a reader that falls RECENT_COMPILES behind loses the oldest)."""
    new = stats.grammar_compiles - seen_compiles
    if new <= 0:
        # None new, or fewer than seen: the engine was rebuilt and counts from 0 again.
        return list(stats.recent_grammar_compile_seconds) if new < 0 else []
    recent = stats.recent_grammar_compile_seconds
    return list(recent[-new:]) if new < len(recent) else list(recent)

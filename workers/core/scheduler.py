"""Token-budget continuous batching with chunked prefill and preemption (vLLM v1 style).

Every step: running sequences first, in admission order (decodes take 1 token, partially
prefilled prompts take a chunk), then waiting sequences in arrival order while the token
budget, `max_num_seqs` and KV blocks last. A long prompt is split across steps, so running
decodes are never starved. When blocks run out, the most recently admitted running
sequence is preempted: its blocks are freed and it goes back to the front of the queue to
be recomputed later (reusing whatever the prefix cache, or its host tier, still holds). A
waiting sequence whose grammar is still compiling (constrained decoding) is passed over.

Priorities and tenants (`EngineInput.priority`, lower is more urgent; `EngineInput.tenant`):
while every live sequence has the same priority and tenant, the order above is all there is
(FIFO). Otherwise each step first orders the running sequences by priority (admission order
within one), so the least urgent is the one preempted, and the waiting queue by level: its
priority minus one for every `priority_aging_s` it has waited. Within a level tenants take
turns (each tenant's first waiting sequence, then each one's second, ...; queue order within a
turn), so a burst of one tenant does not hold another's requests back. Aging bounds
starvation: a request is overtaken by more urgent arrivals for at most (its priority - theirs)
* priority_aging_s seconds.

LoRA: a sequence under an adapter holds one of the device's adapter slots while it runs
(workers/lora/slots.py); while every slot is in use by other adapters it waits, passed over.

A sequence the whole cache cannot hold never loops: once it needs more blocks than the cache
has, or cannot grow (running) or be admitted (waiting) with every other block free, it is
finished (the engine reports finish_reason "length") and its blocks come back. The engine
caps max_model_len to the cache (config.fit_to_kv_cache), so this is the safety net, not the
common path.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from workers.config import SchedulerConfig
from workers.core.block_manager import BlockManager
from workers.core.request import Seq, SeqStatus
from workers.lora.slots import LoraSlotTable
from workers.messages.step import KvTransfers


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Seq, int]]  # (sequence, tokens to compute this step)
    preempted: list[Seq] = field(default_factory=list)
    # Finished here because the whole KV cache cannot hold them (removed, blocks freed).
    out_of_cache: list[Seq] = field(default_factory=list)
    num_batched_tokens: int = 0
    # The host KV tier's copies this step's allocations asked for (workers/core/host_tier.py).
    kv_transfers: KvTransfers | None = None


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        lora_slots: LoraSlotTable | None = None,
    ) -> None:
        self.config = config
        self.bm = block_manager
        self.lora_slots = lora_slots
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.num_preemptions = 0
        # Live sequences per priority and per tenant: the waiting queue is reordered only
        # while either differs among them.
        self._priorities: dict[int, int] = {}
        self._tenants: dict[str | None, int] = {}

    def add(self, seq: Seq) -> None:
        capacity = self.bm.num_blocks * self.bm.block_size
        if seq.prompt_len + 1 > capacity:
            raise ValueError(
                f"prompt ({seq.prompt_len} tokens) can never fit in the KV cache "
                f"({capacity} tokens); raise kv_cache_memory_bytes"
            )
        self.waiting.append(seq)
        _count(self._priorities, seq.priority, 1)
        _count(self._tenants, seq.tenant, 1)

    def remove(self, seq: Seq) -> None:
        """Drops a sequence (finished or aborted) and returns its blocks."""
        if seq.status is not SeqStatus.FINISHED:
            _count(self._priorities, seq.priority, -1)
            _count(self._tenants, seq.tenant, -1)
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)
        self._release_slot(seq)
        seq.status = SeqStatus.FINISHED

    def _release_slot(self, seq: Seq) -> None:
        if seq.lora_slot >= 0:
            self.lora_slots.release(seq.lora_slot)
            seq.lora_slot = -1

    def _preempt(self, seq: Seq, out: SchedulerOutput) -> None:
        seq.draft = []
        self.running.remove(seq)
        self.bm.free(seq)
        self._release_slot(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.sent_blocks = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)

    def _never_fits(self, num_tokens: int) -> bool:
        return self.bm.blocks_needed(num_tokens) > self.bm.num_blocks

    def _finish_out_of_cache(self, seq: Seq, out: SchedulerOutput) -> None:
        self.remove(seq)
        out.out_of_cache.append(seq)

    def _order(self, now: float) -> None:
        """Running: by priority (stable: admission order within one). Waiting: by aged level,
        then tenants' turns (stable: queue order within a turn); module doc."""
        self.running.sort(key=lambda s: s.priority)
        aging = self.config.priority_aging_s
        turns: dict[tuple[int, str | None], int] = {}
        keyed: list[tuple[int, int, Seq]] = []
        for s in self.waiting:
            level = s.priority - math.floor((now - s.arrival_time) / aging)
            turn = turns.get((level, s.tenant), 0)
            turns[(level, s.tenant)] = turn + 1
            keyed.append((level, turn, s))
        keyed.sort(key=lambda k: (k[0], k[1]))
        self.waiting = deque(s for _, _, s in keyed)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        out = SchedulerOutput(scheduled=[])
        now = time.monotonic()
        if len(self._priorities) > 1 or len(self._tenants) > 1:
            self._order(now)
        # 1. Running sequences, oldest admission first (most urgent first, when mixed).
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_pending and self._ends_by_length(seq):
                i += 1  # its token in flight ends it (async scheduling): nothing to compute
                continue
            n = min(seq.num_planned_tokens + len(seq.draft) - seq.num_computed_tokens, budget)
            if seq.draft:  # speculative: its last token and as much of the draft as fits
                del seq.draft[max(n - 1, 0) :]
            while not self.bm.allocate(seq, n):
                if seq.draft:  # no blocks for the draft: decode a token rather than preempt
                    n -= len(seq.draft)
                    seq.draft = []
                    continue
                if len(self.running) == 1 or self._never_fits(seq.num_computed_tokens + n):
                    # Larger than the whole cache (or alone, every other block free, and still
                    # not fitting): it never will, so it ends here instead of preempting the
                    # others and itself for ever.
                    self._finish_out_of_cache(seq, out)
                    break
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, n))
                budget -= n
                i += 1
                continue
            # seq itself was preempted or finished; the list shifted, do not advance i.
        # 2. Waiting sequences, in arrival order, unless we just had to preempt.
        skipped: list[Seq] = []
        while (
            self.waiting
            and budget > 0
            and not out.preempted
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self.waiting[0]
            if seq.gate is not None and not seq.gate.prefill_done and not seq.gate.finished:
                skipped.append(self.waiting.popleft())  # wait for the sibling's prompt blocks
                continue
            if seq.grammar_pending or seq.num_pending:
                # Its grammar is still compiling, or (preempted while a step sampled for it)
                # its last token is not known yet.
                skipped.append(self.waiting.popleft())
                continue
            if seq.lora is not None:
                slot = self.lora_slots.acquire(seq.lora)
                if slot is None:
                    skipped.append(self.waiting.popleft())  # every adapter slot is in use
                    continue
                seq.lora_slot = slot
            cached, restore = [], []
            if seq.num_computed_tokens == 0:
                cached = self.bm.lookup_prefix(seq)
                restore = self.bm.lookup_host(seq, len(cached))  # copied back, not computed
            num_cached = (len(cached) + len(restore)) * self.bm.block_size
            n = min(seq.num_tokens - num_cached, budget)
            if not self.bm.allocate(seq, n, cached, restore):
                self._release_slot(seq)
                if self.running and not self._never_fits(seq.num_tokens):
                    break  # blocks come back as running sequences finish
                # Larger than the whole cache, or no sequence holds a block and seq still does
                # not fit: it never will (a sequence preempted after outgrowing the cache).
                self._finish_out_of_cache(seq, out)
                continue
            if seq.first_scheduled_time is None:
                if self.bm.enable_caching:
                    hit = min(len(cached) * self.bm.block_size, seq.prompt_len)
                    self.bm.record_query(seq.prompt_len, hit)  # the host tier's hits: its own
                seq.num_cached_tokens = min(num_cached, seq.prompt_len)
                seq.first_scheduled_time = now
            seq.num_computed_tokens = num_cached
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        if out.scheduled:  # (allocations schedule: no step, no copies; drops wait for one)
            out.kv_transfers = self.bm.pop_kv_transfers()
        return out

    def _ends_by_length(self, seq: Seq) -> bool:
        """Whether the tokens in flight bring seq to max_tokens or max_model_len."""
        limit = seq.params.max_tokens
        return (
            limit is not None and seq.num_output_tokens + seq.num_pending >= limit
        ) or seq.num_planned_tokens >= self.config.max_model_len


def _count(counts: dict, key: object, delta: int) -> None:
    """Adds `delta` to counts[key], dropping keys that reach 0."""
    left = counts.get(key, 0) + delta
    if left:
        counts[key] = left
    else:
        counts.pop(key, None)

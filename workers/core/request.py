"""Request and sequence state. A `Seq` is the unit the scheduler schedules, one per sample; a
`Request` with n > 1 has n sequences sharing its request_id."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from workers.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Seq:
    seq_id: str
    request_id: str
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    # Cumulative tokens (prompt + outputs); appended in place as tokens are sampled.
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens sampled by a step still in flight (async scheduling, workers/core/engine.py):
    # scheduled for already, their values not yet known (0 or 1).
    num_pending: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Chained hashes of this sequence's full blocks, filled lazily by the block manager.
    block_hashes: list[int] = field(default_factory=list)
    # The block manager's commit watermark (BlockManager.commit_full_blocks): its first
    # `committed_blocks` blocks need no second look, except `duplicate_blocks` (indices),
    # whose hash another block held; they are looked at again once a hash leaves the cache.
    committed_blocks: int = 0
    duplicate_blocks: list[int] = field(default_factory=list)
    duplicates_seen_at: int = 0  # the manager's `num_uncached` when they were last looked at
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    status: SeqStatus = SeqStatus.WAITING
    # The request's priority (lower is more urgent) and arrival (time.monotonic()), which
    # ages a waiting sequence's urgency (workers/core/scheduler.py).
    priority: int = 0
    arrival_time: float = 0.0
    tenant: str | None = None  # the request's tenant: the waiting queue takes tenants in turn
    # The request's LoRA adapter (None: the base model), and the device slot it holds while
    # running (-1: none; workers/lora/slots.py). The adapter's id salts the block hashes.
    lora: Any = None  # workers.lora.request.LoRARequest
    lora_slot: int = -1
    # n > 1: siblings wait for sequence 0's prefill, then reuse its cached prompt blocks.
    gate: Seq | None = None
    # What the workers already hold (the scheduler sends them only the difference).
    sent_tokens: int = 0
    sent_blocks: int = 0
    on_workers: bool = False
    # Timings (time.monotonic seconds).
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # Output-side state owned by the output processor (detokenizer, logprobs, text).
    out: Any = None
    # Constrained decoding (workers.structured): the sequence's grammar matcher, and whether
    # its grammar is still compiling (the scheduler does not admit it until it is ready).
    grammar: Any = None
    grammar_pending: bool = False
    # The marker its grammar waits for (StructuredOutputs.after, e.g. `</think>`'s ids): while
    # set, the grammar is dormant (no mask; the matcher is not fed); None once the outputs end
    # with it, from when the grammar applies, and for grammars that start at once.
    grammar_after: tuple[int, ...] | None = None
    # Its thinking budget's state (SamplingParams.thinking_budget), None without one or once
    # the reasoning block closed.
    thinking: Any = None  # workers.structured.thinking.ThinkingState
    # Speculative decoding (workers/core/speculator.py): the tokens proposed to follow this
    # step (verified with its last token as one chunk; not in token_ids), and its proposer's
    # state (None until it first speculates).
    draft: list[int] = field(default_factory=list)
    spec: Any = None  # workers.core.speculator.SeqSpeculation

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def thinking_bound(self) -> bool:
        """Whether the engine needs its token in flight on the host before the next step (its
        next mask may be forced: ThinkingState.host_bound)."""
        return self.thinking is not None and self.thinking.host_bound

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_planned_tokens(self) -> int:
        """The tokens the scheduler plans with: the known ones and those in flight."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.prompt_len


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # as admitted: eos ids filled in
    seqs: list[Seq]
    arrival_time: float

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)

"""What the engine sends the workers each step (a diff) and what comes back.

Like vLLM v1's scheduler output: a sequence's full data goes to the workers once (when it
is first scheduled, or again after preemption); afterwards a step carries only its id, the
tokens appended since, the blocks added since and how many tokens to compute. The core
builds the diff (`workers.core.step_diff`); the executor carries it, the workers apply it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from workers.lora.request import LoRARequest
from workers.sampling_params import SamplingParams


@dataclass
class NewSeq:
    seq_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # prompt + outputs so far (outputs are non-empty after preemption)
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    num_scheduled: int
    lora_slot: int = -1  # the adapter slot it runs under (-1: the base model)


@dataclass
class CachedSeq:
    seq_id: str
    new_token_ids: list[int]
    new_block_ids: list[int]
    num_computed_tokens: int
    num_scheduled: int
    # Speculative decoding: tokens proposed after the last one, computed in this step's chunk
    # (num_scheduled = 1 + len) and sampled at every position; not the sequence's tokens.
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass
class GrammarBitmask:
    """The tokens each constrained sequence that samples this step may take: row i is
    `seq_ids[i]`'s mask, bit t % 32 of int32 word t // 32 set when token t is allowed. Packed,
    so it travels to the ranks in the step input for 1/32 of a bool mask's bytes."""

    seq_ids: list[str]
    bits: np.ndarray  # [len(seq_ids), ceil(vocab / 32)] int32


@dataclass
class KvTransfers:
    """The host KV tier's copies for this step (workers/core/host_tier.py), which each rank
    applies to its own shard before the forward, in this order: `saves` (and `exports`) copy
    device blocks (as earlier steps left them) to the host pool under their hash, `imports`
    enter the pool, `loads` copy pooled blocks into device blocks (the pool keeps them),
    `drops` leave the pool."""

    saves: list[tuple[int, int]] = field(default_factory=list)  # (block hash, block id)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (block hash, block id)
    drops: list[int] = field(default_factory=list)  # block hashes
    # The cluster tier (workers/core/kv_share.py): `exports` copy device blocks (read with
    # the saves) to the host for another replica, taken by the executor's
    # `take_kv_exports`; `imports` put blocks pulled from another replica into the pool
    # (after the saves, before the loads), each rank taking its own shard.
    exports: list[tuple[int, int]] = field(default_factory=list)  # (block hash, block id)
    imports: list[tuple[int, tuple[np.ndarray, ...]]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads or self.drops or self.exports or self.imports)


@dataclass
class StepInput:
    new: list[NewSeq] = field(default_factory=list)
    cached: list[CachedSeq] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)  # finished, aborted or preempted
    grammar: GrammarBitmask | None = None  # constrained rows only; None when there are none
    # Adapters to put into device slots before this step's forward (workers/lora/slots.py).
    lora_loads: list[tuple[int, LoRARequest]] = field(default_factory=list)
    # Report the tokens per expert with this step whenever it was last reported (an idle
    # engine's last counts: workers/core/expert_report.py).
    report_experts: bool = False
    # The host KV tier's copies, done before the forward (None: none this step).
    kv_transfers: KvTransfers | None = None


@dataclass
class StepOutput:
    seq_ids: list[str]  # sequences that got a token this step
    token_ids: list[int]
    logprobs: list[dict[int, float] | None] | None = None  # per sampled row, when asked
    # SamplingParams.prompt_logprobs: seq_id -> (p, entries), entry j scoring the prompt
    # token at position p + 1 + j (chunks of a prompt arrive over several steps).
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]]]] | None = None
    # SamplingParams.pooling: seq_id -> the pooled embedding, once its prompt is done.
    embeddings: dict[str, list[float]] | None = None
    lora_load_s: float = 0.0  # seconds this step spent loading adapters into slots
    # Mixture-of-experts models, about once a second: the cumulative tokens routed to each
    # expert, [sparse layer][expert] (EngineStats.moe_expert_tokens); None in other steps.
    expert_tokens: tuple[tuple[int, ...], ...] | None = None

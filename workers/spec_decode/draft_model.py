"""Draft-model proposals: a smaller checkpoint with the target's vocabulary decodes each
speculating sequence's next k tokens greedily, and the target verifies them in one step.

The draft runs as an engine of its own (workers/core/engine.py, tensor parallel size 1) inside
the target engine's process, on the same device: on rank 0's side of a tensor-parallel target,
because a draft is small enough that splitting it would cost more in collectives than it saves
in compute, and because proposals are needed where the scheduler runs. Each call batches every
speculating sequence into one draft request each (its whole context as the prompt, k greedy
tokens) and steps the draft engine until they finish; the draft's prefix cache keeps the
context's full blocks from the previous call, so a call computes the few tokens accepted since
plus the k it proposes, not the whole context again. Greedy drafts are deterministic, so the
target's verification (workers/core/speculator.py) keeps its outputs exact.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from workers.outputs import RequestOutputKind
from workers.sampling_params import SamplingParams
from workers.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    from workers.config import EngineConfig

log = logging.getLogger(__name__)

# The draft engine's KV cache: a small model's KV for the target's batch is small, and a fixed
# size cannot take device memory the target sized its own cache to use.
DRAFT_KV_CACHE_BYTES = 256 << 20


class DraftModelProposer:
    def __init__(
        self, config: SpeculativeConfig, target: EngineConfig, make_engine: Callable[..., Any]
    ) -> None:
        """`make_engine`: the engine class (workers.core.engine.LLMEngine), passed in by the
        target's engine rather than imported here: no import cycle."""
        from workers.config import EngineArgs

        args = EngineArgs(
            model=config.model,
            dtype=target.dtype.removeprefix("torch."),
            device=target.device_type,
            kv_cache_memory_bytes=DRAFT_KV_CACHE_BYTES,
            max_num_seqs=target.scheduler.max_num_seqs,
            seed=target.seed,
            cpu_kernels=target.cpu_kernels,
        )
        self.engine = make_engine(args.create_config())
        draft, ours = self.engine.config.model.vocab_size, target.model.vocab_size
        if draft != ours:
            self.engine.shutdown()
            raise ValueError(
                f"speculative_config.model: the draft's vocabulary ({draft} tokens) is not the "
                f"target's ({ours}); a draft model must share the target's tokenizer"
            )
        self.max_model_len = self.engine.max_model_len
        self._next_id = 0
        log.info("draft model %s ready: %s", config.model, self.engine.config.served_model_name)

    def propose_batch(self, items: list[tuple[Any, Any, int]]) -> list[list[int]]:
        """Each (sequence, its speculation state, k): up to k greedy draft tokens."""
        drafts: list[list[int]] = [[] for _ in items]
        pending: dict[str, int] = {}
        for i, (seq, _, k) in enumerate(items):
            k = min(k, self.max_model_len - seq.num_tokens)
            if k <= 0:
                continue
            rid = f"draft-{self._next_id}"
            self._next_id += 1
            params = SamplingParams(
                max_tokens=k,
                temperature=0.0,
                ignore_eos=True,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            try:
                self.engine.add_prompt(rid, list(seq.token_ids), params)
            except ValueError:  # more context than the draft's KV cache holds: no draft
                continue
            pending[rid] = i
        while self.engine.has_unfinished():
            for out in self.engine.step():
                drafts[pending[out.request_id]] = list(out.outputs[0].token_ids)
        return drafts

    def shutdown(self) -> None:
        self.engine.shutdown()

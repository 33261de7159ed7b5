"""A step's sampled tokens entering their sequences (LLMEngine._finish): one token per
sequence, or, for a sequence whose chunk verified a draft, the tokens the verification keeps
(workers/core/speculator.py), each processed as if it had come from its own step."""

from __future__ import annotations

from typing import Any

from workers.core.output_processor import finish_grammar_complete, process_token
from workers.core.request import Request, Seq
from workers.executor.pending import Launched
from workers.messages.step import StepOutput

# The engine is passed in (workers.core.engine.LLMEngine), not imported: no import cycle.


def take_sampled(
    engine: Any, launched: Launched, result: StepOutput, now: float, touched: dict[str, Request]
) -> None:
    """Appends each live sequence's tokens from `result`, retiring those that finish. A
    sequence that ended (or was aborted) while its step was in flight drops its tokens."""
    ids, tokens, lps = result.seq_ids, result.token_ids, result.logprobs
    i = 0
    while i < len(ids):
        sid = ids[i]
        draft = launched.drafts.get(sid)
        rows = 1 + len(draft) if draft else 1
        seq = engine._live(launched, sid)
        if seq is not None:
            kept = tokens[i : i + rows]
            if draft:
                kept = engine.speculator.verify(seq, draft, kept)
            _take(engine, seq, kept, None if lps is None else lps[i : i + rows], now)
            touched[seq.request_id] = engine.requests[seq.request_id]
        i += rows


def _take(engine: Any, seq: Seq, kept: list[int], lps: list | None, now: float) -> None:
    seq.num_pending -= 1
    if seq.first_token_time is None:
        seq.first_token_time = now
        if engine.requests[seq.request_id].seqs[0] is seq:  # once per request
            engine.prompt_tokens += seq.prompt_len
    for j, token in enumerate(kept):
        seq.token_ids.append(token)
        seq.token_times.append(now)
        engine.generation_tokens += 1
        masked = seq.grammar is not None or seq.thinking is not None
        grammar_done = masked and engine.structured.accept(seq, token)
        process_token(seq, token, lps[j] if lps is not None else None, engine.max_model_len)
        if grammar_done:
            finish_grammar_complete(seq)
        if seq.finish_reason is not None:
            engine._retire(seq)
            return
    # A verified draft's accepted tokens were computed in the step (their K/V is in place).
    seq.num_computed_tokens += len(kept) - 1
    if engine.config.scheduler.async_scheduling or len(kept) > 1:
        # Blocks its launch could not enter: tokens known (and computed) only now.
        engine.block_manager.commit_full_blocks(seq)

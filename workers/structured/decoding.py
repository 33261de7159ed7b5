"""`StructuredDecoding`: the engine's side of constrained decoding, between the scheduler and
the workers.

- A constrained request asks the `GrammarCompiler` for its grammar when it is added; its
  sequences are `grammar_pending` (the scheduler skips them, others run) until the compile
  finishes. Then each sequence gets its own matcher (n > 1: one per sample). A compile that
  fails or outlasts `grammar_timeout_s` ends the request: finish_reason "abort", stop_reason
  GRAMMAR_ERROR (the engine has no other per-request error channel; the reason is logged).
- Each step, the sequences that sample get their row of a packed bitmask (`bitmask`), which
  the step input carries to the sampler.
- Each sampled token advances its sequence's matcher (`accept`); a matcher whose grammar is
  complete ends the sequence ("stop").
- A spec with `after` (a reasoning model's end-of-reasoning marker) keeps its sequences'
  grammars dormant (`Seq.grammar_after` set: no mask row, the matcher not fed, never stopped)
  until the outputs end with the marker; the grammar applies from the next token on.
- A thinking budget (`SamplingParams.thinking_budget`, workers/structured/thinking.py) gives
  each sequence a `Seq.thinking` state, advanced by `accept` before the grammar; while it
  forces the end-of-reasoning marker, the sequence's row allows the forced id alone. A grammar
  active (not dormant) at that point wins: the budget forces nothing over it.

Preemption needs nothing: a preempted sequence keeps its generated tokens (only its KV cache
is recomputed), and its matcher has consumed exactly those tokens. A resumed sequence (request
migration, workers/frontend/resume.py) arrives with earlier outputs: its new matcher consumes them
first (those after the marker, when the spec has one), so the grammar continues where it
stopped; a thinking budget's state replays them too.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from workers.core.request import Request, Seq
from workers.messages.step import GrammarBitmask
from workers.structured.backend import CompiledGrammar, MaskFiller, bitmask_words
from workers.structured.compiler import GrammarCompiler
from workers.structured.thinking import ends_with, start_state

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Pending:
    req: Request
    future: Future[CompiledGrammar]
    deadline: float


class StructuredDecoding:
    def __init__(self, compiler: GrammarCompiler, vocab_size: int, timeout_s: float) -> None:
        self.compiler = compiler
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self.timeout_s = timeout_s
        self._pending: dict[str, _Pending] = {}
        # Failures found by add()'s own poll, for the engine's next poll() to finish.
        self._failed: list[tuple[Request, str]] = []
        self._filler = MaskFiller()

    def add(self, req: Request, now: float | None = None) -> None:
        """Starts (or finds cached) the compile of a constrained request's grammar; gives
        each sequence of a request with a thinking budget its state."""
        if req.params.thinking_budget is not None and not self._add_thinking(req):
            return
        spec = req.params.structured_outputs
        if spec is None:
            return
        fut = self.compiler.get(spec)
        start = time.monotonic() if now is None else now
        self._pending[req.request_id] = _Pending(req, fut, start + self.timeout_s)
        for seq in req.seqs:
            seq.grammar_pending = True
        if fut.done():
            # A cached grammar: the request is schedulable in this very step. A failure (a
            # resumed sample's outputs outside the grammar) waits for the engine's poll.
            self._failed += self.poll()

    def _add_thinking(self, req: Request) -> bool:
        """Each sequence's budget state, after its earlier outputs (a resumed sample). False
        (the request failed, for the engine's next poll to finish) for a marker id outside the
        vocabulary, which no mask row can hold."""
        budget = req.params.thinking_budget
        bad = [t for t in budget.end_ids if t >= self.vocab_size]
        if bad:
            for seq in req.seqs:
                seq.grammar_pending = True  # unschedulable: the engine ends it
            self._failed.append((req, f"thinking_budget.end_ids {bad} outside the vocabulary"))
            log.warning("%s: thinking_budget end ids %s not in the vocabulary", req.request_id, bad)
            return False
        for seq in req.seqs:
            seq.thinking = start_state(budget, seq.output_token_ids)
        return True

    def forget(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._failed = [f for f in self._failed if f[0].request_id != request_id]

    @property
    def has_pending(self) -> bool:
        return bool(self._pending or self._failed)

    def poll(self) -> list[tuple[Request, str]]:
        """Gives matchers to requests whose grammar is ready; returns those that failed (the
        caller finishes them), with the reason."""
        failed: list[tuple[Request, str]] = []
        now = time.monotonic()
        for request_id, p in list(self._pending.items()):
            if p.future.done():
                del self._pending[request_id]
                err = p.future.exception()
                if err is not None:
                    failed.append((p.req, f"grammar failed to compile: {err}"))
                    continue
                compiled = p.future.result()
                why = None
                after = p.req.params.structured_outputs.after
                for seq in p.req.seqs:
                    seq.grammar = compiled.matcher()
                    seq.grammar_after = after
                    why = why or _replay(seq)
                if why is not None:
                    failed.append((p.req, why))  # stays unschedulable: the caller ends it
                    continue
                for seq in p.req.seqs:
                    seq.grammar_pending = False
            elif now >= p.deadline:
                del self._pending[request_id]
                failed.append(
                    (p.req, f"grammar not compiled within grammar_timeout_s ({self.timeout_s}s)")
                )
        for req, why in failed:
            log.warning("%s: structured_outputs error: %s", req.request_id, why)
        earlier, self._failed = self._failed, []
        return earlier + failed

    def wait(self, timeout_s: float) -> None:
        """Blocks until a pending compile finishes or `timeout_s`; for a step with nothing
        else to run, so an idle engine does not spin while it waits for a grammar."""
        if not self._pending:
            return
        deadline = min(p.deadline for p in self._pending.values())
        timeout_s = max(0.0, min(timeout_s, deadline - time.monotonic()))
        concurrent.futures.wait(
            [p.future for p in self._pending.values()],
            timeout=timeout_s,
            return_when=concurrent.futures.FIRST_COMPLETED,
        )

    def bitmask(self, scheduled: list[tuple[Seq, int]]) -> GrammarBitmask | None:
        """The mask rows of the constrained sequences that sample a token this step (those
        whose scheduled tokens reach their end: decodes, and last prefill chunks): a grammar's
        allowed tokens, or the one id a thinking budget forces."""
        rows: list[Seq] = []
        forced: list[tuple[Seq, int]] = []
        for seq, n in scheduled:
            if seq.grammar is None and seq.thinking is None:
                continue
            if seq.num_computed_tokens + n < seq.num_tokens:
                continue
            # A dormant grammar leaves its tokens free, or to the budget; an active one wins.
            free = seq.grammar is None or seq.grammar_after is not None
            if free and seq.thinking is not None and (token := seq.thinking.forced) is not None:
                forced.append((seq, token))
            elif not free:
                rows.append(seq)
        if not rows and not forced:
            return None
        bits = np.zeros((len(rows) + len(forced), self.words), dtype=np.int32)
        if rows:
            self._filler.fill([seq.grammar for seq in rows], bits)  # the first rows
        words = bits.view(np.uint32)  # bit 31 is a uint32's, not a (negative) int32's
        for i, (_, token) in enumerate(forced, start=len(rows)):
            words[i, token >> 5] = 1 << (token & 31)
        return GrammarBitmask([s.seq_id for s in rows] + [s.seq_id for s, _ in forced], bits)

    @staticmethod
    def accept(seq: Seq, token: int) -> bool:
        """Advances seq's matcher past its sampled token; True when the grammar is complete
        (seq must stop). A token the grammar refuses (only possible if the mask was not
        applied) also stops it rather than run on unconstrained. A thinking budget's state
        moves first: its forced marker may be what wakes a dormant grammar."""
        thinking = seq.thinking
        if thinking is not None:
            thinking.advance(token)
            if thinking.done:
                seq.thinking = None
        if seq.grammar is None:
            return False
        if seq.grammar_after is not None:
            # Dormant: `token` (already appended) may end the marker; the grammar then
            # applies from the next token. A cheap check: the last token first.
            after = seq.grammar_after
            if token == after[-1] and _outputs_end_with(seq, after):
                seq.grammar_after = None
            return False
        if not seq.grammar.accept(token):
            log.warning("%s: sampled token %d outside its grammar", seq.seq_id, token)
            return True
        return seq.grammar.is_terminated


def _outputs_end_with(seq: Seq, marker: tuple[int, ...]) -> bool:
    """The outputs (token_ids past the prompt) end with `marker`."""
    return seq.num_output_tokens >= len(marker) and ends_with(seq.token_ids, marker)


def _replay(seq: Seq) -> str | None:
    """Advances a new matcher over seq's earlier outputs (a resumed sample; none otherwise) as
    `accept` would have: with `grammar_after`, only the outputs after the marker's first end.
    Returns the reason when they do not fit the grammar (or already complete it: then the
    sample would have finished and cannot be resumed)."""
    outputs = seq.output_token_ids
    start = 0
    if seq.grammar_after is not None:
        start = _marker_end(outputs, seq.grammar_after)
        if start < 0:
            return None  # still dormant: nothing for the matcher yet
        seq.grammar_after = None
    for k in range(start, len(outputs)):
        token = outputs[k]
        if seq.grammar.is_terminated or not seq.grammar.accept(token):
            return f"resumed sample {seq.index}: output {k} (token {token}) is outside its grammar"
    if len(outputs) > start and seq.grammar.is_terminated:
        return f"resumed sample {seq.index}: its outputs already complete the grammar"
    return None


def _marker_end(outputs: list[int], marker: tuple[int, ...]) -> int:
    """The index just past the first occurrence of `marker` in `outputs`; -1 if none."""
    k = len(marker)
    for end in range(k, len(outputs) + 1):
        if outputs[end - 1] == marker[-1] and tuple(outputs[end - k : end]) == marker:
            return end
    return -1

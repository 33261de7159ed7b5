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

Preemption needs nothing: a preempted sequence keeps its generated tokens (only its KV cache
is recomputed), and its matcher has consumed exactly those tokens. A resumed sequence (request
migration, workers/frontend/resume.py) arrives with earlier outputs: its new matcher consumes them
first, so the grammar continues where it stopped.
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

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Pending:
    req: Request
    future: Future[CompiledGrammar]
    deadline: float


class StructuredDecoding:
    def __init__(self, compiler: GrammarCompiler, vocab_size: int, timeout_s: float) -> None:
        self.compiler = compiler
        self.words = bitmask_words(vocab_size)
        self.timeout_s = timeout_s
        self._pending: dict[str, _Pending] = {}
        # Failures found by add()'s own poll, for the engine's next poll() to finish.
        self._failed: list[tuple[Request, str]] = []
        self._filler = MaskFiller()

    def add(self, req: Request, now: float | None = None) -> None:
        """Starts (or finds cached) the compile of a constrained request's grammar."""
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
                for seq in p.req.seqs:
                    seq.grammar = compiled.matcher()
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
        whose scheduled tokens reach their end: decodes, and last prefill chunks)."""
        rows = [
            seq
            for seq, n in scheduled
            if seq.grammar is not None and seq.num_computed_tokens + n >= seq.num_tokens
        ]
        if not rows:
            return None
        bits = np.zeros((len(rows), self.words), dtype=np.int32)
        self._filler.fill([seq.grammar for seq in rows], bits)
        return GrammarBitmask([s.seq_id for s in rows], bits)

    @staticmethod
    def accept(seq: Seq, token: int) -> bool:
        """Advances seq's matcher past its sampled token; True when the grammar is complete
        (seq must stop). A token the grammar refuses (only possible if the mask was not
        applied) also stops it rather than run on unconstrained."""
        if seq.grammar is None:
            return False
        if not seq.grammar.accept(token):
            log.warning("%s: sampled token %d outside its grammar", seq.seq_id, token)
            return True
        return seq.grammar.is_terminated


def _replay(seq: Seq) -> str | None:
    """Advances a new matcher over seq's earlier outputs (a resumed sample; none otherwise);
    the reason when they do not fit the grammar (or already complete it: then the sample would
    have finished and cannot be resumed)."""
    for k, token in enumerate(seq.output_token_ids):
        if seq.grammar.is_terminated or not seq.grammar.accept(token):
            return f"resumed sample {seq.index}: output {k} (token {token}) is outside its grammar"
    if seq.output_token_ids and seq.grammar.is_terminated:
        return f"resumed sample {seq.index}: its outputs already complete the grammar"
    return None

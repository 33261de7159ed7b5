"""`ResumeTracker`: what a request's caller keeps so the request can continue on another engine.

The caller that sees every output of a request (the ingress) feeds them through
`tracker.observe(out)`. Should the engine die mid-request, `tracker.resume_input()` is the
input to send to the next engine: the unfinished samples with everything they generated and
how much of their text the client already has (`EngineInput.resume`). That engine replays it
(see `LLMEngine.add_request`) and goes on token-exact for greedy and seeded sampling; the
client sees one uninterrupted stream, since the new engine hands out only what was not sent.

Nothing extra travels per token: the tracker keeps the deltas the client is sent anyway. The
state is per request and mutable; one tracker serves one request through all its attempts.
"""

from __future__ import annotations

import dataclasses
import time

from workers.inputs import EngineInput, InputChecker, ResumedSample
from workers.outputs import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    RequestOutputKind,
    TokenLogprobs,
)


@dataclasses.dataclass(eq=False)
class _Sample:
    """What the client has of one sample so far (over every attempt)."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: list[str] = dataclasses.field(default_factory=list)  # the deltas, joined when read
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def sent_text(self) -> str:
        if len(self.text) > 1:
            self.text = ["".join(self.text)]
        return self.text[0] if self.text else ""


class ResumeTracker:
    """One request's outputs as its client saw them, to resume it elsewhere (see module doc).

    `checker`, when given, re-checks the resumed input against the next engine's limits
    (`InputChecker.check_resume`); without it the input is built from the observed state as is.
    """

    def __init__(
        self,
        inp: EngineInput,
        checker: InputChecker | None = None,
        arrival_time: float | None = None,
    ) -> None:
        if inp.resume:
            raise ValueError("resume: a tracker starts from the request's original input")
        self.input = inp
        self.checker = checker
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        wants_logprobs = inp.params.logprobs is not None
        self._samples = [
            _Sample(logprobs=[] if wants_logprobs else None) for _ in range(inp.params.n)
        ]
        self._request_id: str | None = None
        self._first_token_time: float | None = None
        self._prompt_logprobs: list[TokenLogprobs | None] | None = None
        self.finished = False
        self.attempts = 1  # engines this request ran on; resume_input() counts the next one

    # -- observing ------------------------------------------------------------------------------
    @property
    def tokens_observed(self) -> int:
        """Output tokens the client has received so far, all samples and attempts together."""
        return sum(len(s.token_ids) for s in self._samples)

    @property
    def streamed(self) -> bool:
        """Whether the client has received anything (only DELTA requests stream)."""
        return self.input.params.output_kind is RequestOutputKind.DELTA and any(
            s.token_ids or s.finish_reason is not None for s in self._samples
        )

    def observe(self, out: RequestOutput) -> RequestOutput:
        """Records one output of the current attempt; returns what the client should get.

        Running outputs pass through unchanged. The finished output gets back the samples that
        finished on an earlier engine (cumulative fields, empty deltas), its outputs in index
        order, and whole-request generation counts."""
        self._request_id = out.request_id
        if out.prompt_logprobs is not None:
            self._prompt_logprobs = out.prompt_logprobs
        if self._first_token_time is None and any(c.delta_token_ids for c in out.outputs):
            self._first_token_time = time.monotonic()
        for c in out.outputs:
            self._record_delta(c)
        if not out.finished:
            return out
        self.finished = True
        present = {c.index for c in out.outputs}
        outputs = list(out.outputs)
        for i, s in enumerate(self._samples):
            if i in present:
                c = next(c for c in out.outputs if c.index == i)
                # Cumulative (the resuming engine replayed the earlier outputs): take it whole.
                s.token_ids, s.text = list(c.token_ids), [c.text]
                s.logprobs = list(c.logprobs) if c.logprobs is not None else s.logprobs
                s.finish_reason, s.stop_reason = c.finish_reason, c.stop_reason
            elif s.finish_reason is not None:
                outputs.append(self._cumulative(i))
        outputs.sort(key=lambda c: c.index)
        metrics = out.metrics
        if metrics is not None:
            metrics = dataclasses.replace(
                metrics, num_generation_tokens=sum(len(c.token_ids) for c in outputs)
            )
        return dataclasses.replace(out, outputs=outputs, metrics=metrics)

    def _record_delta(self, c: CompletionOutput) -> None:
        s = self._samples[c.index]
        if s.finish_reason is not None:
            return  # a finished sample's later outputs repeat its finish, nothing else
        s.token_ids.extend(c.delta_token_ids)
        if c.delta_text:
            s.text.append(c.delta_text)
        if s.logprobs is not None and c.delta_logprobs:
            s.logprobs.extend(c.delta_logprobs)
        if c.finish_reason is not None:
            s.finish_reason, s.stop_reason = c.finish_reason, c.stop_reason

    def _cumulative(self, i: int) -> CompletionOutput:
        s = self._samples[i]
        return CompletionOutput(
            index=i,
            text=s.sent_text(),
            token_ids=list(s.token_ids),
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
            logprobs=list(s.logprobs) if s.logprobs is not None else None,
        )

    # -- resuming -------------------------------------------------------------------------------
    def resume_input(self) -> EngineInput | None:
        """The input for the next engine, or None when every sample has finished (then
        `final_output()` is the request's finished output).

        The original input when the client has nothing yet (a FINAL_ONLY request, or no token
        streamed): a re-run from scratch, which gives the same output for greedy and seeded
        requests. Otherwise the unfinished samples continue from what the client has."""
        if self.finished:
            return None
        if not self.streamed:
            self.attempts += 1
            return self.input
        samples = [
            ResumedSample(
                index=i,
                output_token_ids=tuple(s.token_ids),
                text_sent=len(s.sent_text()),
                logprobs=tuple(s.logprobs) if s.logprobs is not None else None,
            )
            for i, s in enumerate(self._samples)
            if s.finish_reason is None
        ]
        if not samples:
            return None
        self.attempts += 1
        if self.checker is not None:
            return self.checker.check_resume(self.input, samples)
        return dataclasses.replace(self.input, resume=tuple(samples))

    def final_output(self) -> RequestOutput:
        """The finished output built from what was observed, once every sample finished
        (`resume_input()` returned None) without the engine's finished output arriving."""
        if any(s.finish_reason is None for s in self._samples):
            raise RuntimeError("final_output: some samples of the request have not finished")
        outputs = [self._cumulative(i) for i in range(len(self._samples))]
        now = time.monotonic()
        inp = self.input
        self.finished = True
        return RequestOutput(
            request_id=self._request_id or "",
            prompt=inp.prompt,
            prompt_token_ids=list(inp.prompt_token_ids),
            outputs=outputs,
            finished=True,
            prompt_logprobs=self._prompt_logprobs,
            metrics=RequestMetrics(
                arrival_time=self.arrival_time,
                first_token_time=self._first_token_time,
                finished_time=now,
                num_prompt_tokens=len(inp.prompt_token_ids),
                num_generation_tokens=sum(len(c.token_ids) for c in outputs),
            ),
        )

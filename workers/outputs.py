"""What the engine hands back: one RequestOutput per request, one CompletionOutput per sample.

Which outputs a request gets is its `SamplingParams.output_kind`:

- `RequestOutputKind.DELTA` (streaming): one output per engine step that gave the request a
  token. A running output carries only what changed: `delta_text`, `delta_token_ids`,
  `delta_logprobs`, and `finish_reason` / `stop_reason` of samples that have finished; its
  cumulative fields (`prompt`, `prompt_token_ids`, `text`, `token_ids`, `logprobs`) are empty.
- `RequestOutputKind.FINAL_ONLY`: nothing until the request finishes.

Either way the finished output (`finished=True`) carries everything: the cumulative fields,
the last delta and `metrics`. The engine builds only what the kind asks for, so nothing is
built to be thrown away (vLLM's `RequestOutputKind` is the model). `merge_outputs` folds a run
of a request's outputs into one (a stream that fell behind sends fewer, larger chunks).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

# The stop_reason of a request that no engine step took before its queue timeout (its
# finish_reason is "abort"): the server turns it into a retryable 503, never shows it.
QUEUE_TIMEOUT = "queue_timeout"


class RequestOutputKind(enum.Enum):
    DELTA = "delta"  # running outputs with deltas only, then the finished output
    FINAL_ONLY = "final_only"  # only the finished output


# One position's logprobs: {token_id: logprob} holding the top-N and the chosen token.
TokenLogprobs = dict[int, float]


@dataclass
class CompletionOutput:
    """One of the n samples of a request: cumulative fields (finished output only) and the
    delta since the previous output of the request."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: list[TokenLogprobs] | None = None
    # Streaming deltas: what this yield adds to the previous one.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None  # set on the final output
    # `SamplingParams.prompt_logprobs`: one entry per prompt token, the first None (nothing
    # predicts it). On the finished output, and on the first running output of a DELTA
    # request once its prompt is done.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # `SamplingParams.pooling`: the pooled hidden state, on the finished output only.
    embedding: list[float] | None = None


@dataclass
class RequestMetrics:
    """Per-request timings (time.monotonic() seconds) and token counts, on the final output."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0


def ended_unrun(out: RequestOutput, stop_reason: str) -> bool:
    """Whether a finished output is a request the engine ended before it generated anything,
    every sample aborted with `stop_reason` (QUEUE_TIMEOUT, the grammar backend's error)."""
    return (
        out.finished
        and bool(out.outputs)
        and all(o.stop_reason == stop_reason and not o.token_ids for o in out.outputs)
    )


def is_queue_timeout(out: RequestOutput) -> bool:
    """Whether a finished output is a request that timed out in the queue, unrun."""
    return ended_unrun(out, QUEUE_TIMEOUT)


def merge_outputs(outs: Sequence[RequestOutput]) -> RequestOutput:
    """One RequestOutput equivalent to `outs` in order: the last state of each sample, all
    its deltas, and its finish reason even if only an earlier output carried it (a delta
    output reports a sample's finish once)."""
    last = outs[-1]
    if len(outs) == 1:
        return last
    parts_of: dict[int, list[CompletionOutput]] = {}
    for o in outs:
        for c in o.outputs:
            parts_of.setdefault(c.index, []).append(c)
    merged: list[CompletionOutput] = []
    for index in sorted(parts_of):
        parts = parts_of[index]
        c = parts[-1]
        done = next((p for p in reversed(parts) if p.finish_reason is not None), c)
        lps = [p.delta_logprobs for p in parts if p.delta_logprobs]
        merged.append(
            dataclasses.replace(
                c,
                finish_reason=done.finish_reason,
                stop_reason=done.stop_reason,
                delta_text="".join(p.delta_text for p in parts),
                delta_token_ids=[t for p in parts for t in p.delta_token_ids],
                delta_logprobs=[x for lp in lps for x in lp] if lps else c.delta_logprobs,
            )
        )
    # The prompt logprobs ride on one running output (the first after the prompt): keep them.
    prompt_lps = next((o.prompt_logprobs for o in outs if o.prompt_logprobs), last.prompt_logprobs)
    return dataclasses.replace(last, outputs=merged, prompt_logprobs=prompt_lps)

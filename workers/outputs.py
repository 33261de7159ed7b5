"""What the engine hands back: one RequestOutput per request, one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

# One position's logprobs: {token_id: logprob} holding the top-N and the chosen token.
TokenLogprobs = dict[int, float]


@dataclass
class CompletionOutput:
    """One of the n samples of a request. Cumulative fields plus the delta since the last yield."""

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
    error: str | None = None
    metrics: RequestMetrics | None = None  # set on the final output


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


def deltas_only(out: RequestOutput) -> RequestOutput:
    """A running output without its cumulative fields: what a stream consumer needs, and far
    less to serialize per chunk (the finished output still carries everything)."""
    if out.finished or (not out.prompt_token_ids and not any(c.token_ids for c in out.outputs)):
        return out  # finished, or stripped already (the process core sends them so)
    return replace(
        out,
        prompt=None,
        prompt_token_ids=[],
        outputs=[replace(c, text="", token_ids=[], logprobs=None) for c in out.outputs],
    )

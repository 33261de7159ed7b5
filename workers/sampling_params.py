"""SamplingParams: what a request asks of the sampler and the stop checker (vLLM's names)."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

from workers.outputs import RequestOutputKind
from workers.pooling import Pooling
from workers.structured.spec import StructuredOutputs
from workers.structured.thinking import ThinkingBudget

# Top-N logprobs per token are capped: each one costs a top-k over the vocabulary and a
# Python object per token in every streamed delta. 20 is OpenAI's cap for top_logprobs.
MAX_LOGPROBS = 20

# Output tokens when a request names none: vLLM's and OpenAI's completions default; the
# HTTP and gRPC completions read it from here.
DEFAULT_MAX_TOKENS = 16


@dataclass
class SamplingParams:
    """Per-request sampling and stopping options; bad values raise ValueError naming the field."""

    n: int = 1
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    # Log-probabilities of the prompt's tokens (the first has none), each with the top-N
    # at its position: scoring and evaluation harnesses. Computed from the prefill's logits
    # at every prompt position, so such a request skips the prefix cache (module doc of
    # workers/core/scheduler.py) and only its first sample computes them.
    prompt_logprobs: int | None = None
    # An embedding request (workers/pooling.py): prefill only, pooled hidden states instead
    # of tokens; n must be 1.
    pooling: Pooling | None = None
    skip_special_tokens: bool = True
    # What the engine produces: deltas while running (streaming), or only the final output.
    output_kind: RequestOutputKind = RequestOutputKind.DELTA
    # Constrained decoding (JSON schema, regex, choice, grammar); checked at the ingress with
    # workers.structured.check_structured, compiled by the engine off the step loop.
    structured_outputs: StructuredOutputs | None = None
    # A cap on reasoning tokens: past it the engine forces the end-of-reasoning marker
    # (workers/structured/thinking.py); the ingress builds it from the reasoning parser's markers.
    thinking_budget: ThinkingBudget | None = None
    # Filled in by the engine, never by users: EOS ids from the checkpoint.
    eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop) if self.stop is not None else []
        self.stop_token_ids = list(self.stop_token_ids) if self.stop_token_ids else []
        self.validate()

    def derived(self, **changes: object) -> SamplingParams:
        """A copy with `changes`, not validated again (`dataclasses.replace` would): for the
        engine, which derives each sample's params (its seed, the EOS ids) from checked ones,
        so a request's params are validated once, by the input check, not once per sample."""
        new = copy.copy(self)
        for name, value in changes.items():
            setattr(new, name, value)
        return new

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def needs_every_prompt_position(self) -> bool:
        """Prompt logprobs and mean pooling need the hidden state of every prompt token, which
        a prefix-cache hit would skip: such a request computes its whole prompt. Its blocks
        still enter the cache for the requests after it."""
        return self.prompt_logprobs is not None or (
            self.pooling is not None and self.pooling.kind == "mean"
        )

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}")

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(
                "min_tokens", f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        # NaN and ±Infinity pass range checks like `>= 0` (or turn logits into NaN): each
        # float field is first a finite number, named when it is not.
        for name in _FLOAT_FIELDS:
            v = getattr(self, name)
            if not _is_num(v):
                raise bad(name, f"must be a finite number, got {v!r}")
        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature!r}")
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or (self.top_k < -1 or self.top_k == 0):
            raise bad("top_k", f"must be -1 (disabled) or >= 1, got {self.top_k!r}")
        if not _is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        if not all(isinstance(s, str) for s in self.stop):
            raise bad("stop", "must be a string or a list of strings")
        if any(s == "" for s in self.stop):
            raise bad("stop", "must not contain empty strings")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not -2.0 <= v <= 2.0:
                raise bad(name, f"must be in [-2, 2], got {v!r}")
        if not _is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise bad(
                "logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
            )
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise bad(
                "prompt_logprobs",
                f"must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}",
            )
        if self.pooling is not None:
            if not isinstance(self.pooling, Pooling):
                raise bad("pooling", f"must be a Pooling, got {type(self.pooling).__name__}")
            if self.n != 1:
                raise bad("n", f"must be 1 for an embedding request, got {self.n!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", f"must be a RequestOutputKind, got {self.output_kind!r}")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputs
        ):
            raise bad(
                "structured_outputs",
                f"must be a StructuredOutputs, got {type(self.structured_outputs).__name__}",
            )
        if self.thinking_budget is not None and not isinstance(
            self.thinking_budget, ThinkingBudget
        ):
            raise bad(
                "thinking_budget",
                f"must be a ThinkingBudget, got {type(self.thinking_budget).__name__}",
            )


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def _is_num(v: object) -> bool:
    """A finite int or float (not bool, NaN or ±Infinity)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

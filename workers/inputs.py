"""A request checked once, at the edge, into the engine's own type (`EngineInput`).

`InputChecker` holds the limits of one served model (vocabulary, max_model_len, and the KV
cache's capacity for one sequence, which caps max_model_len at start-up) and is the
only place a request is validated: the ingresses call it before routing, the offline `LLM`
and `AsyncEngine.generate` call it for raw prompts. A request is checked once
(`InputChecker.request`: its SamplingParams, priority, adapter and tenant), then each of its
prompts (`CheckedRequest.input`), which gives the EngineInput as the engine runs it; `check`
does both for a request of one prompt. Everything behind it (LLMServer, the engine cores,
`LLMEngine.add_request`) trusts an EngineInput as it is. Errors are ValueErrors
whose message starts with the field they blame ("prompt ...", "max_tokens ...", "top_p ..."),
which is how `cluster.errors.invalid_from_value_error` names the field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from workers.lora.request import LoRARequest
from workers.outputs import TokenLogprobs
from workers.sampling_params import SamplingParams

if TYPE_CHECKING:
    from workers.messages.kv_blocks import KvBlockData


class _Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class ResumedSample:
    """One sample of a request that continues on another engine (request migration, see
    workers/frontend/resume.py): what it generated before, and how much of its text the client has.

    The engine re-creates the sample with these outputs (same index, so the same seed), replays
    them through its output state and continues token-exact where it stopped."""

    index: int  # the sample's index in [0, n): its seed is seed + index
    output_token_ids: tuple[int, ...]  # every token it generated, handed out or not
    text_sent: int  # characters of its text the client already received
    logprobs: tuple[TokenLogprobs, ...] | None = None  # one per output token, when asked


@dataclass(frozen=True, slots=True)
class EngineInput:
    """A request the engine runs as is: built only by InputChecker."""

    prompt_token_ids: tuple[int, ...]
    params: SamplingParams  # validated; eos ids NOT filled (the engine does that)
    prompt: str | None = None  # text, when the caller had it (offline API); None from servers
    # Empty: a fresh request. Else a resumed one: only these samples run, each continuing
    # from its outputs (samples that already finished are not listed). See check_resume.
    resume: tuple[ResumedSample, ...] = ()
    # Lower is more urgent (vLLM's convention): orders the waiting queue and picks who is
    # preempted first (workers/core/scheduler.py).
    priority: int = 0
    # Who sent it (the ingress names tenants; None: nobody in particular). The waiting queue
    # takes tenants in turn within a priority level, so one tenant's burst cannot hold
    # another's requests back (workers/core/scheduler.py).
    tenant: str | None = None
    # The LoRA adapter to run under (None: the base model). Checked by the engine when it
    # first sees the adapter (workers/lora/checkpoint.py); servers resolve names to it.
    lora: LoRARequest | None = None
    # KV blocks of its prompt another replica computed, pulled from the cluster tier by the
    # replica (cluster/replica/kv_share.py): the engine checks them and copies them in
    # instead of computing those tokens (workers/core/kv_share.py). Not part of the request.
    kv_blocks: tuple[KvBlockData, ...] = ()


@dataclass(frozen=True)
class InputChecker:
    """The limits of one served model."""

    vocab_size: int
    max_model_len: int
    # Tokens the KV cache holds for one sequence (num_blocks * block_size), when known. The
    # engine caps max_model_len to it at start-up; here it only names the real limit in errors
    # (and bounds requests, should a checker be built without that cap).
    kv_cache_tokens: int | None = None

    def _limit(self) -> tuple[int, str]:
        """The context limit and how error messages name it."""
        limit, kv = self.max_model_len, self.kv_cache_tokens
        if kv is None or kv > limit:
            return limit, f"max_model_len ({limit})"
        return kv, (
            f"max_model_len ({kv}), the KV cache's capacity of {kv} tokens for one sequence "
            "(a larger KV cache raises it)"
        )

    def request(
        self,
        params: SamplingParams,
        priority: int = 0,
        *,
        lora: LoRARequest | None = None,
        tenant: str | None = None,
    ) -> CheckedRequest:
        """Validates what a request asks of every one of its prompts (params, priority) once;
        its prompts are then checked each by the result (a completions request carries many)."""
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        # Again, though construction validated: the dataclass is mutable and callers may have
        # changed a field since.
        params.validate()
        if not isinstance(priority, int) or isinstance(priority, bool) or abs(priority) >= 2**31:
            raise ValueError(f"priority must be a 32-bit integer, got {priority!r}")
        if lora is not None and not isinstance(lora, LoRARequest):
            raise ValueError(f"lora must be a LoRARequest, got {type(lora).__name__}")
        return CheckedRequest(self, params, priority, lora, tenant)

    def check(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        prompt: str | None = None,
        field: str = "prompt",
        priority: int = 0,
        *,
        lora: LoRARequest | None = None,
        tenant: str | None = None,
    ) -> EngineInput:
        """A request of one prompt, as the engine runs it (under `lora`, for `tenant`);
        `field` names the prompt in error messages."""
        req = self.request(params, priority, lora=lora, tenant=tenant)
        return req.input(prompt_token_ids, prompt, field)

    def check_prompt(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        tokenizer: _Encoder,
        field: str = "prompt",
        priority: int = 0,
        *,
        lora: LoRARequest | None = None,
        tenant: str | None = None,
    ) -> EngineInput:
        """`check` for a prompt given as text (encoded with `tokenizer`) or as token ids."""
        req = self.request(params, priority, lora=lora, tenant=tenant)
        return req.prompt(prompt, tokenizer, field)

    def token_ids(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, field: str
    ) -> tuple[int, ...]:
        """The prompt's ids, in the vocabulary and leaving room for max_tokens (`params`
        validated already)."""
        if isinstance(prompt_token_ids, (str, bytes)) or not isinstance(prompt_token_ids, Sequence):
            raise ValueError(f"{field} must be a list of token ids")
        ids = tuple(prompt_token_ids)
        if not ids:
            raise ValueError(f"{field} must not be empty")
        vocab = self.vocab_size
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"{field} token id {t!r} is outside the vocabulary [0, {vocab})")
        limit, named = self._limit()
        if params.pooling is not None:
            # An embedding request generates nothing: the prompt may fill the whole context.
            if len(ids) > limit:
                raise ValueError(f"{field} is {len(ids)} tokens, over {named}")
            return ids
        if len(ids) >= limit:
            raise ValueError(
                f"{field} is {len(ids)} tokens, which leaves no room to generate within {named}"
            )
        if params.max_tokens is not None and len(ids) + params.max_tokens > limit:
            raise ValueError(
                f"max_tokens ({params.max_tokens}) + {field} length ({len(ids)}) exceeds {named}"
            )
        return ids

    def check_resume(self, inp: EngineInput, samples: Sequence[ResumedSample]) -> EngineInput:
        """`inp` (checked already) continuing from `samples`: the unfinished samples of an
        earlier attempt with what each generated. Errors start with "resume"."""
        if not isinstance(inp, EngineInput):
            raise ValueError("resume needs a checked EngineInput")
        if isinstance(samples, (str, bytes)) or not isinstance(samples, Sequence) or not samples:
            raise ValueError("resume must list at least one unfinished sample")
        p = inp.params
        limit, named = self._limit()
        seen: set[int] = set()
        for s in samples:
            if not isinstance(s, ResumedSample):
                raise ValueError(f"resume samples must be ResumedSample, got {type(s).__name__}")
            i = s.index
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < p.n:
                raise ValueError(f"resume sample index {i!r} is outside [0, n={p.n})")
            if i in seen:
                raise ValueError(f"resume sample index {i} is listed twice")
            seen.add(i)
            out = s.output_token_ids
            if not isinstance(out, tuple):
                raise ValueError(f"resume sample {i} output_token_ids must be a tuple of ids")
            for t in out:
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                    raise ValueError(
                        f"resume sample {i} token id {t!r} is outside the vocabulary "
                        f"[0, {self.vocab_size})"
                    )
            total = len(inp.prompt_token_ids) + len(out)
            if total >= limit:
                raise ValueError(
                    f"resume sample {i}: prompt + outputs ({total} tokens) leave no room to "
                    f"generate within {named}"
                )
            if p.max_tokens is not None and len(out) >= p.max_tokens:
                raise ValueError(
                    f"resume sample {i} has {len(out)} outputs: max_tokens ({p.max_tokens}) "
                    "leaves none to generate"
                )
            if not isinstance(s.text_sent, int) or isinstance(s.text_sent, bool) or s.text_sent < 0:
                raise ValueError(f"resume sample {i} text_sent must be an int >= 0")
            if p.logprobs is None:
                if s.logprobs is not None:
                    raise ValueError(f"resume sample {i} has logprobs the request did not ask for")
            elif s.logprobs is None or len(s.logprobs) != len(out):
                raise ValueError(
                    f"resume sample {i} needs one logprobs entry per output token ({len(out)})"
                )
        ordered = tuple(sorted(samples, key=lambda s: s.index))
        return replace(inp, resume=ordered)


@dataclass(frozen=True)
class CheckedRequest:
    """A request whose params, priority, adapter and tenant are checked (`InputChecker.request`);
    each of its prompts becomes an EngineInput through `input` or `prompt`."""

    checker: InputChecker
    params: SamplingParams
    priority: int = 0
    lora: LoRARequest | None = None
    tenant: str | None = None

    def input(
        self, prompt_token_ids: Sequence[int], prompt: str | None = None, field: str = "prompt"
    ) -> EngineInput:
        """One prompt's token ids checked against the model; `field` names it in errors."""
        ids = self.checker.token_ids(prompt_token_ids, self.params, field)
        return EngineInput(
            ids, self.params, prompt, priority=self.priority, tenant=self.tenant, lora=self.lora
        )

    def prompt(
        self, prompt: str | Sequence[int], tokenizer: _Encoder, field: str = "prompt"
    ) -> EngineInput:
        """`input` for a prompt given as text (encoded with `tokenizer`) or as token ids."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"{field} must not be empty")
            return self.input(tokenizer.encode(prompt), prompt, field)
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError(f"{field} must be a non-empty string or a non-empty list of token ids")
        return self.input(prompt, None, field)

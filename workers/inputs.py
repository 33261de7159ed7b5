"""A request checked once, at the edge, into the engine's own type (`EngineInput`).

`InputChecker` holds the limits of one served model (vocabulary, max_model_len, and the KV
cache's capacity for one sequence, which caps max_model_len at start-up) and is the
only place a request is validated: the ingresses call it before routing, the offline `LLM`
and `AsyncEngine.generate` call it for raw prompts. Everything behind it (LLMServer, the
engine cores, `LLMEngine.add_request`) trusts an EngineInput as it is. Errors are ValueErrors
whose message starts with the field they blame ("prompt ...", "max_tokens ...", "top_p ..."),
which is how `cluster.errors.invalid_from_value_error` names the field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from workers.sampling_params import SamplingParams


class _Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class EngineInput:
    """A request the engine runs as is: built only by InputChecker."""

    prompt_token_ids: tuple[int, ...]
    params: SamplingParams  # validated; eos ids NOT filled (the engine does that)
    prompt: str | None = None  # text, when the caller had it (offline API); None from servers


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

    def check(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        prompt: str | None = None,
        field: str = "prompt",
    ) -> EngineInput:
        """Validates params and token ids; `field` names the prompt in error messages."""
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        params.validate()
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
        if len(ids) >= limit:
            raise ValueError(
                f"{field} is {len(ids)} tokens, which leaves no room to generate within {named}"
            )
        if params.max_tokens is not None and len(ids) + params.max_tokens > limit:
            raise ValueError(
                f"max_tokens ({params.max_tokens}) + {field} length ({len(ids)}) exceeds {named}"
            )
        return EngineInput(ids, params, prompt)

    def check_prompt(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        tokenizer: _Encoder,
        field: str = "prompt",
    ) -> EngineInput:
        """`check` for a prompt given as text (encoded with `tokenizer`) or as token ids."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"{field} must not be empty")
            return self.check(tokenizer.encode(prompt), params, prompt, field)
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError(f"{field} must be a non-empty string or a non-empty list of token ids")
        return self.check(prompt, params, None, field)

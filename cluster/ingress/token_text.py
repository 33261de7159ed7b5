"""Token text for logprobs, shared by both ingresses so they render a token the same way."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Enough for any vocabulary; a bound so a broken decode can never grow memory without end.
_MAX_CACHED = 1_000_000


class TokenStrings:
    """Token id -> its text, as logprobs show it (cached: the same ids recur constantly)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._cache: dict[int, str] = {}

    @staticmethod
    def of(tokenizer: Any) -> TokenStrings:
        """Each token decoded on its own with special tokens kept (logprobs show them too)."""
        return TokenStrings(lambda ids: tokenizer.decode(ids, skip_special_tokens=False))

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._decode([token_id])
            if len(self._cache) < _MAX_CACHED:
                self._cache[token_id] = s
        return s

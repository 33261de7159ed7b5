"""`--speculative-config`: vLLM's JSON shape, read into a frozen config at the edge.

    {"method": "ngram", "num_speculative_tokens": 4,
     "prompt_lookup_min": 2, "prompt_lookup_max": 4, "adaptive": true}

    {"method": "draft_model", "model": "/ckpt/small", "num_speculative_tokens": 4}

`method`: "ngram" (prompt lookup: the tokens that followed the latest earlier occurrence of the
context's last n tokens, n from prompt_lookup_max down to prompt_lookup_min) or "draft_model"
(`model`: a smaller checkpoint with the target's vocabulary, which proposes greedily:
workers/spec_decode/draft_model.py). `adaptive` (kvray's key, default true): each sequence's
draft length follows its measured acceptance and the step's measured cost per token
(workers/spec_decode/adaptive.py); false proposes up to num_speculative_tokens every step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
# What vLLM's shape also names, not served by kvray yet: refused by name, not ignored.
_NOT_YET = ("eagle", "eagle3", "suffix", "medusa", "mtp")
_KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "adaptive",
    "model",
)
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    adaptive: bool = True
    model: str | None = None  # draft_model: the draft checkpoint's directory

    @staticmethod
    def parse(value: str | dict[str, Any] | None) -> SpeculativeConfig | None:
        """From the flag's JSON text (or its dict); None for None or "". Raises ValueError
        naming the key and value that are wrong."""
        if value is None or value == "":
            return None
        raw = value
        if isinstance(value, str):
            try:
                raw = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"speculative_config: not JSON ({err.msg})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        unknown = sorted(set(raw) - set(_KEYS))
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key {unknown[0]!r} (known: {', '.join(_KEYS)})"
            )
        method = raw.get("method", "ngram")
        if method in _NOT_YET:
            raise ValueError(
                f"speculative_config.method {method!r} is not supported yet: kvray proposes "
                f"with {', '.join(METHODS)}"
            )
        if method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {method!r}")
        k = raw.get("num_speculative_tokens")
        if not _int_in(k, 1, MAX_SPECULATIVE_TOKENS):
            raise ValueError(
                "speculative_config.num_speculative_tokens must be an integer in "
                f"1..{MAX_SPECULATIVE_TOKENS}, got {k!r}"
            )
        hi = raw.get("prompt_lookup_max", 4)
        lo = raw.get("prompt_lookup_min", min(2, hi) if _int_in(hi, 1, 64) else 2)
        for key, v in (("prompt_lookup_max", hi), ("prompt_lookup_min", lo)):
            if not _int_in(v, 1, 64):
                raise ValueError(f"speculative_config.{key} must be an integer in 1..64, got {v!r}")
        if lo > hi:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({lo}) exceeds prompt_lookup_max ({hi})"
            )
        adaptive = raw.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be true or false, got {adaptive!r}")
        model = raw.get("model")
        if method == "draft_model" and not (isinstance(model, str) and model):
            raise ValueError("speculative_config.model: draft_model needs the draft checkpoint")
        if method != "draft_model" and model is not None:
            raise ValueError(f"speculative_config.model is for draft_model, not {method!r}")
        return SpeculativeConfig(method, k, lo, hi, adaptive, model)

    def describe(self) -> str:
        mode = "adaptive" if self.adaptive else "fixed"
        what = (
            f"draft {self.model}"
            if self.method == "draft_model"
            else f"n-grams of {self.prompt_lookup_min}..{self.prompt_lookup_max}"
        )
        return f"{self.method} (up to {self.num_speculative_tokens} tokens, {mode}, {what})"


def _int_in(v: object, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi

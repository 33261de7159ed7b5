"""Pooling: what an embedding request asks of the engine instead of sampling.

A request whose `SamplingParams.pooling` is set is prefill only: the engine runs its prompt,
pools the last layer's hidden states after the final norm (the `last_hidden_state` of a
transformers model) and finishes it with `RequestOutput.embedding`; no token is sampled and
no KV block stays held after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PoolingKind = Literal["last", "mean"]
POOLING_KINDS: tuple[str, ...] = ("last", "mean")


@dataclass(frozen=True)
class Pooling:
    # "last": the last prompt token's hidden state (decoder models' default, as vLLM's);
    # "mean": the mean over every prompt token.
    kind: PoolingKind = "last"
    # L2-normalised, as vLLM's embedding default: cosine similarity is then a dot product.
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.kind not in POOLING_KINDS:
            raise ValueError(
                f"pooling must be one of {', '.join(POOLING_KINDS)}, got {self.kind!r}"
            )
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a boolean, got {self.normalize!r}")

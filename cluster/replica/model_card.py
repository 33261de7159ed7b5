"""A replica's model card: what `/v1/models`, gRPC ListModels and the ingresses' request
checks read of the model it serves (LLMServer.model_card)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from workers.quantization import describe as describe_quantization

if TYPE_CHECKING:
    from workers.frontend.async_engine import AsyncEngine


def model_card(name: str, engine: AsyncEngine, created: int) -> dict[str, Any]:
    """{"id", "max_model_len", "vocab_size", "kv_cache_tokens", "created"}: the limits the
    ingresses check requests against (the model's vocabulary, which can be larger than the
    tokenizer's); and "quantization", "kv_cache_dtype": what the weights and the KV cache
    are stored as."""
    config = engine.config
    return {
        "id": name,
        "max_model_len": int(engine.max_model_len),
        "vocab_size": engine.input_checker.vocab_size,
        "kv_cache_tokens": engine.input_checker.kv_cache_tokens,
        "created": created,
        "quantization": describe_quantization(config.model.quantization),
        "kv_cache_dtype": config.kv_dtype_name,
    }

"""A replica's model card (cluster/replica/model_card.py): the limits the ingresses check, and
what the weights and the KV cache are stored as, from the engine's own config."""

from __future__ import annotations

from pathlib import Path

from cluster.replica.model_card import model_card
from workers import AsyncEngine, EngineArgs


def test_the_card_names_the_quantization_and_the_kv_cache_dtype(demo_dir: Path) -> None:
    args = EngineArgs(model=str(demo_dir), kv_cache_dtype="fp8", kv_cache_memory_bytes=4 << 20)
    engine = AsyncEngine(args)
    try:
        card = model_card("m", engine, 7)
    finally:
        engine.shutdown()
    assert card["id"] == "m" and card["created"] == 7
    assert card["max_model_len"] == engine.max_model_len > 0
    assert card["vocab_size"] == engine.input_checker.vocab_size
    assert (card["quantization"], card["kv_cache_dtype"]) == ("none", "float8_e4m3fn")

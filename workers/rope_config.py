"""Rotary embedding settings of a checkpoint (default, linear and llama3 scaling), read from
config.json in either spelling. Its own module so that the families' settings
(workers/gemma_config.py) read ropes without importing workers/config.py, which imports them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> RopeConfig:
        """Reads both spellings: `rope_parameters` (new) and `rope_theta`/`rope_scaling` (old)."""
        params = cfg.get("rope_parameters")
        if params is None:
            params = dict(cfg.get("rope_scaling") or {})
            if "rope_theta" in cfg:
                params.setdefault("rope_theta", cfg["rope_theta"])
        params = dict(params)
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope type {rope_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        return RopeConfig(
            theta=float(params.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=params.get("original_max_position_embeddings"),
        )

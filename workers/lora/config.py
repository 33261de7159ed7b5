"""The engine's LoRA limits, fixed at start-up (EngineArgs.enable_lora and friends)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_LORAS = 8
DEFAULT_MAX_LORA_RANK = 64
DEFAULT_MAX_CPU_LORAS = 32


@dataclass(frozen=True)
class LoraConfig:
    # Adapters on the device at once: one step serves requests of at most this many.
    max_loras: int = DEFAULT_MAX_LORAS
    # The largest rank an adapter may have (the device slots are sized for it).
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    # Adapters each process keeps read from disk (host memory), least recently used dropped.
    max_cpu_loras: int = DEFAULT_MAX_CPU_LORAS

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )

    @staticmethod
    def from_args(max_loras: int, max_lora_rank: int, max_cpu_loras: int | None) -> LoraConfig:
        """EngineArgs' values; max_cpu_loras None: max(DEFAULT_MAX_CPU_LORAS, max_loras)."""
        if max_cpu_loras is None and isinstance(max_loras, int):
            max_cpu_loras = max(DEFAULT_MAX_CPU_LORAS, max_loras)
        return LoraConfig(max_loras, max_lora_rank, max_cpu_loras)

"""What names an adapter for a request: vLLM's `LoRARequest`, field for field."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter for one request.

    `lora_int_id` identifies the adapter's weights: it keys the device slots and salts the
    prefix cache's block hashes, so two adapters (or one reloaded from a changed file) must
    not share it. Servers assign it; offline callers pick it, as in vLLM.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None  # informational (vLLM's field)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if (
            not isinstance(self.lora_int_id, int)
            or isinstance(self.lora_int_id, bool)
            or not 0 < self.lora_int_id < 2**63
        ):
            raise ValueError(f"lora_int_id must be an integer > 0, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path must be a non-empty path")

"""LoRA adapters served next to their base model (many fine-tunes, one engine).

`request.LoRARequest` names an adapter (vLLM's type and field names); `config.LoraConfig` the
engine's limits (slots on the device, the largest rank); `checkpoint` reads and checks a PEFT
adapter; `slots` assigns adapters to the device's slots (engine core); `layers` holds the
slots' weights next to each projection and adds a step's deltas (device).
"""

from workers.lora.request import LoRARequest

__all__ = ["LoRARequest"]

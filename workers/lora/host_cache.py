"""Adapters read from disk and checked, the most recently used kept on the host.

An adapter is needed twice when a request first names it: the engine core checks it before
anything is scheduled (workers/lora/slots.py), and a worker needs its weights when it first
puts it into a device slot (workers/lora/device.py). With the worker in the engine's process
(TP = 1: `InProcessExecutor`) both use the worker's one `AdapterCache`, so the adapter's files
are read once: what the check read is what the slot load finds. Ranks in other processes
(TP > 1) keep their own and read the files when they first load the adapter, as each reads
its shard of the base weights.
"""

from __future__ import annotations

from collections import OrderedDict

from workers.config import ModelConfig
from workers.lora.checkpoint import LoraAdapter, load_adapter
from workers.lora.request import LoRARequest


class AdapterCache:
    """At most `capacity` adapters (max_cpu_loras), keyed by id and path, least recently used
    evicted first; a miss reads and checks the adapter (LoraError for a bad one, not kept)."""

    def __init__(self, model: ModelConfig, max_lora_rank: int, capacity: int) -> None:
        self.model = model
        self.max_lora_rank = max_lora_rank
        self.capacity = capacity
        self._adapters: OrderedDict[tuple[int, str], LoraAdapter] = OrderedDict()

    def get(self, req: LoRARequest) -> LoraAdapter:
        # The path is part of the key: an id is never meant to name other files, but if it
        # does, the new files are read rather than the old weights served.
        key = (req.lora_int_id, req.lora_path)
        adapter = self._adapters.get(key)
        if adapter is not None:
            self._adapters.move_to_end(key)
            return adapter
        adapter = load_adapter(req.lora_path, self.model, self.max_lora_rank)
        self._adapters[key] = adapter
        while len(self._adapters) > self.capacity:
            self._adapters.popitem(last=False)
        return adapter

    def __len__(self) -> int:
        return len(self._adapters)

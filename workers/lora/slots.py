"""Which adapter sits in which device slot: the engine core's side of LoRA (no torch).

The device holds `max_loras` adapters (workers/lora/layers.py). A sequence under an adapter
takes a reference on its slot when the scheduler admits it and gives it back when it stops
running (finished, aborted or preempted). An adapter not in a slot gets a free slot, else the
least recently used idle one (its adapter is evicted: no running sequence uses it); when every
slot is in use, the sequence waits (the scheduler passes over it, as over a grammar still
compiling) and requests of the adapters already in slots go on. A slot in use is never
evicted. A new placement is sent to the workers with the step that first needs it.

Adapters are checked once, when a request first names them (`check`): a bad file fails that
request with `LoraError` (a ValueError: a 400 at the servers) before anything is scheduled.
With the worker in this process, the check reads through the worker's host cache
(workers/lora/host_cache.py), so the slot load finds the adapter read already.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from workers.config import EngineConfig, ModelConfig
from workers.lora.config import LoraConfig
from workers.lora.request import LoRARequest

if TYPE_CHECKING:
    from workers.lora.host_cache import AdapterCache


class LoraSlotTable:
    def __init__(
        self, config: LoraConfig, model: ModelConfig, adapters: AdapterCache | None = None
    ) -> None:
        self.config = config
        self.model = model
        # The in-process worker's host cache (None: the ranks are other processes, which read
        # the adapter themselves; the check here reads it and lets it go).
        self.host_cache = adapters
        n = config.max_loras
        self.ids: list[int | None] = [None] * n  # lora_int_id per slot
        self.users = [0] * n  # running sequences per slot
        self.slot_of: dict[int, int] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()  # slots nobody uses, LRU first
        self.pending: list[tuple[int, LoRARequest]] = []  # placements the workers lack
        self.checked: OrderedDict[tuple[int, str], None] = OrderedDict()
        self.loads = 0
        self.evictions = 0

    @staticmethod
    def of(config: EngineConfig, adapters: AdapterCache | None) -> LoraSlotTable | None:
        """The engine's table (None without LoRA); `adapters`: the executor's in-process host
        cache, through which a check reads, so the adapter's slot load reads nothing again."""
        return None if config.lora is None else LoraSlotTable(config.lora, config.model, adapters)

    def check(self, lora: LoRARequest) -> None:
        """Reads the adapter once per (id, path) and checks it fits the model (LoraError)."""
        key = (lora.lora_int_id, lora.lora_path)
        if key in self.checked:
            self.checked.move_to_end(key)
            return
        if self.host_cache is not None:
            self.host_cache.get(lora)  # kept for the worker's slot load
        else:
            from workers.lora.checkpoint import load_adapter  # torch: once adapters are used

            load_adapter(lora.lora_path, self.model, self.config.max_lora_rank)
        self.checked[key] = None
        while len(self.checked) > self.config.max_cpu_loras:
            self.checked.popitem(last=False)

    def acquire(self, lora: LoRARequest) -> int | None:
        """A slot holding `lora` for one more sequence, or None while every slot is in use."""
        slot = self.slot_of.get(lora.lora_int_id)
        if slot is None:
            slot = self._place(lora)
            if slot is None:
                return None
        self.users[slot] += 1
        self.idle.pop(slot, None)
        return slot

    def release(self, slot: int) -> None:
        self.users[slot] -= 1
        if self.users[slot] == 0:
            self.idle[slot] = None  # most recently used last

    def _place(self, lora: LoRARequest) -> int | None:
        free = [s for s, i in enumerate(self.ids) if i is None]
        if free:
            slot = free[0]
        elif self.idle:
            slot, _ = self.idle.popitem(last=False)
            del self.slot_of[self.ids[slot]]
            self.evictions += 1
        else:
            return None
        self.ids[slot] = lora.lora_int_id
        self.slot_of[lora.lora_int_id] = slot
        self.pending.append((slot, lora))
        self.loads += 1
        return slot

    def take_loads(self) -> list[tuple[int, LoRARequest]]:
        loads, self.pending = self.pending, []
        return loads

    def adapters(self) -> tuple[int, ...]:
        """The ids in slots, least recently used first (slots in use count as most recent)."""
        idle = [self.ids[s] for s in self.idle]
        busy = [i for s, i in enumerate(self.ids) if i is not None and s not in self.idle]
        return tuple(idle + busy)

    @property
    def used(self) -> int:
        return sum(i is not None for i in self.ids)

"""The engine core's adapter slots: placement, reuse, LRU eviction of idle slots only."""

from __future__ import annotations

from workers.config import ModelConfig
from workers.lora.config import LoraConfig
from workers.lora.request import LoRARequest
from workers.lora.slots import LoraSlotTable


def _req(i: int) -> LoRARequest:
    return LoRARequest(f"a{i}", i, f"/adapters/a{i}")


def _table(n: int) -> LoraSlotTable:
    return LoraSlotTable(
        LoraConfig(max_loras=n, max_cpu_loras=max(n, 4)), ModelConfig.__new__(ModelConfig)
    )


def test_an_adapter_is_placed_once_and_shared() -> None:
    t = _table(2)
    assert t.acquire(_req(1)) == 0 and t.acquire(_req(1)) == 0
    assert t.take_loads() == [(0, _req(1))] and t.take_loads() == []
    assert t.acquire(_req(2)) == 1
    assert t.users == [2, 1] and t.used == 2 and t.loads == 2


def test_a_slot_in_use_is_never_evicted_and_the_lru_idle_one_is() -> None:
    t = _table(2)
    s1, s2 = t.acquire(_req(1)), t.acquire(_req(2))
    assert t.acquire(_req(3)) is None  # both in use: the sequence waits
    t.release(s2)
    t.release(s1)  # now idle: a2 then a1 (a2 least recently used)
    assert t.adapters() == (2, 1)
    assert t.acquire(_req(3)) == s2 and t.evictions == 1
    assert t.take_loads()[-1] == (s2, _req(3))
    # a1 is still placed: taking it again loads nothing.
    assert t.acquire(_req(1)) == s1 and t.take_loads() == []
    assert t.acquire(_req(2)) is None  # a2 was evicted and no slot is idle


def test_a_released_slot_keeps_its_adapter_until_needed() -> None:
    t = _table(1)
    t.release(t.acquire(_req(1)))
    assert t.used == 1 and t.adapters() == (1,)
    assert t.acquire(_req(1)) == 0 and t.evictions == 0 and t.loads == 1

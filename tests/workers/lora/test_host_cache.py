"""The host cache of adapters read from disk: one read per adapter while it is kept, shared by
the engine's check and the in-process worker's slot load (an adapter's files are read once on
its first use)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.workers.lora.adapters import write_random_adapter
from workers import LLM, SamplingParams
from workers.config import ModelConfig
from workers.lora.checkpoint import CONFIG_FILE, WEIGHTS_FILE, LoraError
from workers.lora.host_cache import AdapterCache
from workers.lora.request import LoRARequest


@pytest.fixture(scope="module")
def base(checkpoints: dict[str, Path]) -> Path:
    return checkpoints["llama"]


@pytest.fixture(scope="module")
def adapters(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {n: write_random_adapter(base, root / n, rank=4, seed=i) for i, n in enumerate("abc")}


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Reads of each adapter's files (config and weights), by directory name, whoever reads."""
    import safetensors.torch

    counts: Counter = Counter()
    load_file = safetensors.torch.load_file
    read_text = Path.read_text

    def counted_load(file: Any, *args: Any, **kwargs: Any) -> Any:
        if Path(file).name == WEIGHTS_FILE:
            counts[(Path(file).parent.name, WEIGHTS_FILE)] += 1
        return load_file(file, *args, **kwargs)

    def counted_text(self: Path, *args: Any, **kwargs: Any) -> str:
        if self.name == CONFIG_FILE:
            counts[(self.parent.name, CONFIG_FILE)] += 1
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "load_file", counted_load)
    monkeypatch.setattr(Path, "read_text", counted_text)
    return counts


def _req(adapters: dict[str, Path], name: str, lora_id: int | None = None) -> LoRARequest:
    return LoRARequest(name, lora_id or "abc".index(name) + 1, str(adapters[name]))


def test_each_adapter_is_read_once_while_kept(base: Path, adapters, reads: Counter) -> None:
    cache = AdapterCache(ModelConfig.from_pretrained(base), max_lora_rank=8, capacity=2)
    a = cache.get(_req(adapters, "a"))
    assert cache.get(_req(adapters, "a")) is a and reads[("a", WEIGHTS_FILE)] == 1
    cache.get(_req(adapters, "b"))
    cache.get(_req(adapters, "a"))  # a is now the most recently used: b goes first
    cache.get(_req(adapters, "c"))
    assert len(cache) == 2 and reads[("b", WEIGHTS_FILE)] == 1
    cache.get(_req(adapters, "a"))
    assert reads[("a", WEIGHTS_FILE)] == 1
    cache.get(_req(adapters, "b"))  # evicted: read again
    assert reads[("b", WEIGHTS_FILE)] == 2
    # The same id with another path is other files: read, not the old weights served.
    assert cache.get(_req(adapters, "c", lora_id=1)).path == str(adapters["c"])


def test_a_bad_adapter_is_refused_and_not_kept(base: Path, tmp_path: Path) -> None:
    cache = AdapterCache(ModelConfig.from_pretrained(base), max_lora_rank=8, capacity=2)
    with pytest.raises(LoraError, match="does not exist"):
        cache.get(LoRARequest("x", 1, str(tmp_path / "missing")))
    assert len(cache) == 0


def test_an_adapters_files_are_read_once_on_its_first_use(
    base: Path, adapters, reads: Counter
) -> None:
    """The engine's check (before anything is scheduled) and the worker's slot load (the step
    that first runs the adapter) share the in-process worker's host cache."""
    llm = LLM(str(base), enable_lora=True, max_lora_rank=8, kv_cache_memory_bytes=4 << 20)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    try:
        llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False, lora_request=_req(adapters, "a"))
        assert llm.stats().lora_loads == 1
        assert reads == Counter({("a", CONFIG_FILE): 1, ("a", WEIGHTS_FILE): 1})
        llm.generate([[5, 6]], params, use_tqdm=False, lora_request=_req(adapters, "a"))
        assert reads == Counter({("a", CONFIG_FILE): 1, ("a", WEIGHTS_FILE): 1})
    finally:
        llm.engine.shutdown()

"""Greedy outputs under LoRA adapters equal transformers with peft's merged weights (float32):
mixed batches of base-model requests and several adapters, on every family, on the CPU
kernels' path and torch's, compiled, with fewer slots than adapters, chunked prefill,
preemption and the prefix cache in play, and at TP 2."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tests.checkpoints import KINDS, hf_greedy, load_hf
from tests.gemma_checkpoints import make_gemma_checkpoint
from tests.moe_checkpoints import make_moe_checkpoint
from tests.workers.lora.adapters import merged_hf_model, write_random_adapter
from tests.workers.parity import assert_greedy_match
from workers import LLM, SamplingParams
from workers.config import ModelConfig
from workers.lora import LoRARequest
from workers.lora.checkpoint import LoraError

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


class Family:
    """A base checkpoint, adapters of it, and the oracle models (built once, when asked)."""

    def __init__(self, base: Path, root: Path, targets: tuple[str, ...] | None = None) -> None:
        self.base = base
        kw: dict[str, Any] = {} if targets is None else {"target_modules": targets}
        # Ranks differ (slots hold any rank up to the cap); a1 and a3 leave some modules alone.
        self.adapters = {
            "a1": write_random_adapter(base, root / "a1", rank=8, seed=1, **kw),
            "a2": write_random_adapter(base, root / "a2", rank=4, alpha=8, seed=2, **kw),
            "a3": write_random_adapter(
                base, root / "a3", rank=16, seed=3, target_modules=("q_proj", "v_proj")
            ),
        }
        self._hf: dict[str | None, Any] = {}

    def request(self, name: str) -> LoRARequest:
        ids = {"a1": 1, "a2": 2, "a3": 3}
        return LoRARequest(name, ids[name], str(self.adapters[name]))

    def hf(self, name: str | None) -> Any:
        if name not in self._hf:
            path = self.base
            self._hf[name] = (
                load_hf(path) if name is None else merged_hf_model(path, self.adapters[name])
            )
        return self._hf[name]

    def check(self, prompts: list[list[int]], names: list[str | None], outs: list[Any]) -> None:
        for prompt, name, out in zip(prompts, names, outs, strict=True):
            hf = self.hf(name)
            ours = list(out.outputs[0].token_ids)
            assert_greedy_match(hf, prompt, ours, hf_greedy(hf, prompt, MAX_TOKENS))


def _mixed(lengths: list[int], names: list[str | None], seed: int = 0) -> tuple[list, list]:
    """Every prompt under every name, interleaved (one batch mixes them all)."""
    rng = random.Random(seed)
    prompts, who = [], []
    for n in lengths:
        p = [rng.randrange(3, 3800) for _ in range(n)]
        for name in names:
            prompts.append(p)
            who.append(name)
    return prompts, who


@pytest.fixture(scope="module")
def families(checkpoints, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Family]:
    root = tmp_path_factory.mktemp("lora")
    return {kind: Family(checkpoints[kind], root / kind) for kind in KINDS}


def _llm(family: Family, **kw: Any) -> LLM:
    args = {"enable_lora": True, "max_lora_rank": 16, "kv_cache_memory_bytes": 16 << 20} | kw
    return LLM(str(family.base), **args)


def _generate(llm: LLM, family: Family, prompts: list, names: list) -> list[Any]:
    loras = [None if n is None else family.request(n) for n in names]
    return llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_mixed_batch_matches_the_merged_models(kind: str, kernels: bool, families) -> None:
    family = families[kind]
    llm = _llm(family, cpu_kernels=kernels)
    prompts, names = _mixed([1, 5, 17, 40], [None, "a1", "a2", "a3"])
    outs = _generate(llm, family, prompts, names)
    family.check(prompts, names, outs)
    # The adapters changed the outputs (the test can fail): not every one equals the base's.
    base = {
        tuple(p): o.outputs[0].token_ids
        for p, n, o in zip(prompts, names, outs, strict=True)
        if n is None
    }
    changed = [
        o.outputs[0].token_ids != base[tuple(p)]
        for p, n, o in zip(prompts, names, outs, strict=True)
        if n
    ]
    assert sum(changed) >= len(changed) // 2, changed
    stats = llm.stats()
    assert stats.kv_blocks_used == 0 and stats.lora_slots_used == 3 and stats.lora_loads == 3
    assert llm.engine.lora_slots.users == [0] * 8  # every slot reference came back


def test_fewer_slots_than_adapters_queues_and_evicts(families) -> None:
    family = families["llama"]
    llm = _llm(family, max_loras=1, max_num_seqs=4)
    prompts, names = _mixed([3, 20, 33], ["a1", None, "a2", "a3"], seed=1)
    outs = _generate(llm, family, prompts, names)
    family.check(prompts, names, outs)
    stats = llm.stats()
    assert stats.lora_slots_total == 1 and stats.lora_slots_used == 1
    assert stats.lora_loads >= 3 and stats.lora_evictions == stats.lora_loads - 1
    assert stats.kv_blocks_used == 0


def test_prefix_cache_and_chunked_prefill(families) -> None:
    family = families["qwen3"]
    llm = _llm(family, max_num_batched_tokens=48)  # prompts prefill in chunks
    prompts, names = _mixed([70, 90], [None])
    family.check(prompts, names, _generate(llm, family, prompts, names))
    # The same prompts again, now under adapters: the base model's cached blocks must not serve
    # them (other K/V), but each adapter's own second run does hit its own blocks.
    names = ["a1", "a2"] * 2
    prompts = [prompts[0], prompts[0], prompts[1], prompts[1]]
    hits = llm.stats().prefix_cache_hits
    family.check(prompts, names, _generate(llm, family, prompts, names))
    assert llm.stats().prefix_cache_hits == hits
    family.check(prompts, names, _generate(llm, family, prompts, names))
    assert llm.stats().prefix_cache_hits > hits


def test_preemption_gives_slots_back_and_takes_them_again(families) -> None:
    family = families["mistral"]
    c = ModelConfig.from_pretrained(family.base)
    per_block = 2 * c.num_layers * 16 * c.num_kv_heads * c.head_dim * 4  # K and V, float32
    # 12 blocks of 16 tokens: six 30-token prompts fill them, and growing preempts some.
    llm = _llm(family, kv_cache_memory_bytes=12 * per_block, max_loras=2)
    prompts, names = _mixed([30, 31, 29], [None, "a1", "a2", "a3"], seed=7)
    family.check(prompts, names, _generate(llm, family, prompts, names))
    assert llm.stats().num_preemptions > 0
    assert llm.engine.lora_slots.users == [0, 0] and llm.stats().kv_blocks_used == 0


def test_compiled_forward_serves_base_steps_and_adapters_run_eagerly(families) -> None:
    family = families["llama"]
    llm = _llm(family, compile=True, compile_min_tokens=1)
    prompts, names = _mixed([4, 30], [None, "a2"], seed=2)
    family.check(prompts, names, _generate(llm, family, prompts, names))


def test_moe_and_gemma_families(tmp_path: Path) -> None:
    moe = make_moe_checkpoint("qwen3_moe", tmp_path / "moe")
    # A mixture-of-experts model takes adapters on attention (its experts take none).
    family = Family(moe, tmp_path / "moe-a", targets=ATTENTION)
    prompts, names = _mixed([6, 33], [None, "a1", "a3"], seed=3)
    family.check(prompts, names, _generate(_llm(family), family, prompts, names))
    gemma = Family(make_gemma_checkpoint(tmp_path / "gemma"), tmp_path / "gemma-a")
    prompts, names = _mixed([6, 33], [None, "a1", "a2"], seed=4)
    gemma.check(prompts, names, _generate(_llm(gemma), gemma, prompts, names))


@pytest.mark.usefixtures("ray_session")
def test_tensor_parallel_2_matches(families) -> None:
    family = families["qwen2"]  # q/k/v biases, and two KV heads: one per rank
    llm = _llm(family, tensor_parallel_size=2)
    try:
        prompts, names = _mixed([3, 40], [None, "a1", "a2", "a3"], seed=5)
        family.check(prompts, names, _generate(llm, family, prompts, names))
    finally:
        llm.engine.shutdown()


def test_bad_requests_are_refused_before_anything_runs(families, tmp_path: Path) -> None:
    family = families["llama"]
    plain = LLM(str(family.base), kv_cache_memory_bytes=4 << 20)
    with pytest.raises(ValueError, match="lora: this engine serves no adapters"):
        plain.generate([[5, 6]], GREEDY, use_tqdm=False, lora_request=family.request("a1"))
    llm = _llm(family, max_lora_rank=8)
    with pytest.raises(LoraError, match="max_lora_rank"):  # a3 has rank 16
        llm.generate([[5, 6], [7, 8]], GREEDY, use_tqdm=False, lora_request=family.request("a3"))
    missing = LoRARequest("gone", 9, str(tmp_path / "nowhere"))
    with pytest.raises(LoraError, match="nowhere"):
        llm.generate([[5, 6]], GREEDY, use_tqdm=False, lora_request=missing)
    assert not llm.engine.has_unfinished() and llm.stats().kv_blocks_used == 0
    # The engine still serves.
    prompts, names = _mixed([4], [None, "a1"], seed=6)
    family.check(prompts, names, _generate(llm, family, prompts, names))


def test_the_per_adapter_path_matches_too(families, monkeypatch) -> None:
    """Every projection of every step with several adapters computed per adapter (the path
    large steps take), instead of masked (the one these tiny models' steps take)."""
    from workers.lora import layers

    monkeypatch.setattr(layers, "SEGMENT_FIXED_MACS", {"cpu": 0.0, "cuda": 0.0})
    monkeypatch.setattr(layers, "SEGMENT_GATHER_MACS", {"cpu": 0.0, "cuda": 0.0})
    family = families["qwen3"]
    prompts, names = _mixed([2, 19, 40], [None, "a1", "a2", "a3"], seed=8)
    family.check(prompts, names, _generate(_llm(family), family, prompts, names))


def test_the_triton_backend_adds_the_deltas_too(families) -> None:
    """The triton backend's fused layers (CPU: Triton's interpreter, tests/conftest.py) with
    adapters: the projections' deltas go in before the fused norms and activations."""
    pytest.importorskip("triton")
    family = families["qwen3"]
    llm = _llm(family, attention_backend="triton", cpu_kernels=False)
    assert llm.engine.executor.worker.model.triton_layers is not None
    prompts, names = _mixed([3, 20], [None, "a1", "a3"], seed=9)
    family.check(prompts, names, _generate(llm, family, prompts, names))


def test_speculative_decoding_verifies_under_each_sequences_adapter(families) -> None:
    """Drafts (from the plain engine's outputs, some made wrong) verified in chunks whose rows
    carry each sequence's adapter: the outputs stay the plain LoRA engine's."""
    from tests.workers.spec_decode.oracle import OracleProposer, reference_of

    family = families["llama"]
    prompts, names = _mixed([3, 17], [None, "a1", "a2"])
    ref = _generate(_llm(family), family, prompts, names)
    spec_config = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    llm = _llm(family, speculative_config=spec_config)
    oracle = OracleProposer(reference_of(ref, names), llm.engine.vocab_size)
    llm.engine.speculator.proposer = oracle
    outs = _generate(llm, family, prompts, names)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in ref]
    assert llm.stats().spec_decode_accepted_tokens > 0

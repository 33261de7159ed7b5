"""The KV tiers' CUDA copy path (run by tests/gpu/check.sh): pinned host memory and a copy
stream of their own (workers/device/kv_offload.py). On a bf16 CUDA engine: a prefix evicted to
the host tier comes back with the tokens of a run that never evicted it, and blocks exported
for the cluster tier and imported again after the cache is emptied restore the same tokens."""

from __future__ import annotations

import pytest
import torch

from workers import LLM, SamplingParams
from workers.demo import demo_model_dir

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PREFIX = list(range(10, 10 + 16 * 16))  # 16 full blocks
PROMPTS = [
    PREFIX + [200, 201],
    *([300 + 7 * k + i for i in range(300)] for k in range(3)),
    PREFIX + [400],
]


def _tokens(llm: LLM) -> list[list[int]]:
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]


def test_cuda_host_tier_restores_evicted_blocks() -> None:
    model = str(demo_model_dir())
    ref = _tokens(LLM(model, dtype="bfloat16", kv_cache_memory_bytes=64 << 20))
    from workers.config import EngineArgs
    from workers.kv_layout import kv_block_bytes

    per_block = kv_block_bytes(EngineArgs(model=model, dtype="bfloat16").create_config(), 1)
    # 24 blocks: each prompt fits; the shared prefix does not stay on the device.
    small = LLM(model, dtype="bfloat16", kv_cache_memory_bytes=24 * per_block, kv_offload_gib=0.05)
    assert _tokens(small) == ref
    assert small.stats().kv_offload_copies_in >= 16


def test_cuda_cluster_tier_export_and_import() -> None:
    from dataclasses import replace

    from workers.core.kv_events import BlocksExported

    llm = LLM(
        str(demo_model_dir()),
        dtype="bfloat16",
        kv_cache_memory_bytes=64 << 20,
        kv_offload_gib=0.05,
        kv_events=True,
        kv_share=True,
    )
    first = llm.generate([PREFIX + [1]], GREEDY, use_tqdm=False)[0]
    events = llm.engine.block_manager.pop_kv_events()
    blocks = [b for e in events if isinstance(e, BlocksExported) for b in e.blocks]
    assert len(blocks) == 16
    llm.engine.block_manager.reset_prefix_cache()
    engine = llm.engine
    inp = engine.input_checker.request(GREEDY).prompt(PREFIX + [1], engine.tokenizer)
    engine.add_request("pulled", replace(inp, kv_blocks=tuple(blocks)))
    again = llm._run(["pulled"], use_tqdm=False)[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.num_cached_tokens == 16 * 16

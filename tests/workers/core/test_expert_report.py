"""An idle mixture-of-experts engine's tokens per expert are current (workers/core/
expert_report.py): four requests back to back on an AsyncEngine (its core a thread here, which
starts faster than the child process an engine replica runs; the step loop is the same), then
its stats count every token each request routed, with no request after them, under both
scheduling modes. The replica exports those stats as they are (cluster/replica/moe_metrics.py,
tested in tests/cluster/replica/test_moe_metrics.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from workers import AsyncEngine, EngineArgs, SamplingParams
from workers.core.expert_report import latest_expert_tokens

TOP_K = 2


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.moe_checkpoints import make_moe_checkpoint

    root = tmp_path_factory.mktemp("moe")
    return make_moe_checkpoint("qwen3_moe", root / "e8k2", num_experts=8, top_k=TOP_K)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_last_request_s_tokens_are_counted_once_idle(
    moe_dir: Path, async_scheduling: bool
) -> None:
    args = EngineArgs(
        model=str(moe_dir),
        kv_cache_memory_bytes=8 << 20,
        enable_prefix_caching=False,
        async_scheduling=async_scheduling,
    )
    engine = AsyncEngine(args)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[5 + i] * (6 + 3 * i) for i in range(4)]

    async def back_to_back() -> None:
        for i, prompt in enumerate(prompts):
            async for _ in engine.generate(prompt, params, f"r{i}"):
                pass

    try:
        asyncio.run(back_to_back())
        # Each token the model was fed, once per expert of its top-k, in every sparse layer:
        # the prompt, then every output token but the last (which is never fed back).
        fed = sum(len(p) + params.max_tokens - 1 for p in prompts)
        deadline = time.monotonic() + 60  # a hang guard, not a speed check
        while True:
            rows = engine.stats().moe_expert_tokens
            if rows and all(sum(row) == fed * TOP_K for row in rows):
                break
            assert time.monotonic() < deadline, (fed * TOP_K, [sum(r) for r in rows])
            time.sleep(0.05)
    finally:
        engine.shutdown()


def test_the_larger_report_is_the_newer() -> None:
    old, new = ((3, 1), (2, 2)), ((4, 2), (3, 3))
    assert latest_expert_tokens((), old) == old
    assert latest_expert_tokens(old, new) == new
    assert latest_expert_tokens(new, old) == new  # a step in flight resolved after the idle report
    assert latest_expert_tokens(new, None) == new

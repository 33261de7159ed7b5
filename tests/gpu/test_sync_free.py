"""On CUDA, a step's forward never waits for the device (run by tests/gpu/check.sh): the
triton backend's forward, eager and from the whole-step decode graphs, and the LM head run
under torch.cuda.set_sync_debug_mode("error"), which raises on any synchronising call
(.item(), .tolist(), .cpu(), a blocking copy)."""

from __future__ import annotations

import random
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from tests.checkpoints import make_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@contextmanager
def _no_sync() -> Any:
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


class _Unsynced:
    """The worker's forward with every call checked."""

    def __init__(self, forward: Any) -> None:
        self._forward = forward
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._forward, name)

    def hidden_states(self, *args: Any) -> torch.Tensor:
        self.calls += 1
        with _no_sync():
            return self._forward.hidden_states(*args)


def _warm_triton_llm(path: Any, compile: bool, **engine: Any) -> tuple[Any, list, Any]:
    """A bfloat16 engine on the triton backend that has run the test's prompts once (Triton
    compiles each kernel on its first launch), with those prompts and greedy params."""
    from workers import LLM, SamplingParams

    llm = LLM(
        str(path),
        dtype="bfloat16",
        device="cuda",
        compile=compile,
        kv_cache_memory_bytes=1 << 30,
        attention_backend="triton",
        **engine,
    )
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 3800) for _ in range(n)] for n in (1, 17, 64, 129, 300)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    return llm, prompts, params


@pytest.mark.parametrize(
    ("kind", "compile"),
    [("qwen3", False), ("qwen3", True), ("qwen3_moe", False)],
    ids=["triton-eager", "triton-graphs", "triton-moe"],
)
def test_the_forward_never_syncs(kind: str, compile: bool, tmp_path) -> None:
    pytest.importorskip("triton")
    from tests.moe_checkpoints import make_moe_checkpoint

    if kind == "qwen3_moe":  # the experts as grouped GEMMs, no per-layer host sync
        path = make_moe_checkpoint(kind, tmp_path / kind, num_experts=8, top_k=2)
    else:
        path = make_checkpoint(kind, tmp_path / kind)
    llm, prompts, params = _warm_triton_llm(path, compile)
    worker = llm.engine.executor.worker
    checked = _Unsynced(worker.forward)
    worker.forward = checked
    logits = worker.model.logits

    def unsynced_logits(*args: Any) -> torch.Tensor:
        with _no_sync():
            return logits(*args)

    worker.model.logits = unsynced_logits
    llm.generate(prompts, params, use_tqdm=False)
    assert checked.calls > 0
    if compile:  # decode steps replayed their graphs, under the same check
        assert checked.compiled.graphs.replays > 0
    llm.engine.shutdown()


@pytest.mark.parametrize("compile", [False, True], ids=["eager-async", "graphs-async"])
def test_an_async_launch_never_syncs(compile: bool, tmp_path) -> None:
    """With async scheduling a step's launch (its upload, the placeholders' fill from the last
    step's tokens, the forward, the sampling and the start of the copy to the host) returns
    without waiting for the device: only `result()` waits, on an event."""
    pytest.importorskip("triton")
    from workers import SamplingParams

    path = make_checkpoint("qwen3", tmp_path / "qwen3")
    llm, prompts, params = _warm_triton_llm(path, compile, async_scheduling=True)
    worker = llm.engine.executor.worker
    launch = worker.launch
    ahead = []

    def unsynced_launch(step: Any) -> Any:
        with _no_sync():
            pending = launch(step)
        # Two unknown tokens: the last step's, read on the device, and this one's.
        ahead.append(sum(s.num_placeholders == 2 for s in worker.states.values()))
        return pending

    worker.launch = unsynced_launch
    llm.generate(prompts, params, use_tqdm=False)
    assert max(ahead) == len(prompts)  # every decode ran ahead of the host
    # Sampled rows too: temperature, top-p without top-k (a full sort on CUDA, no probe),
    # top-k, min-p, seeds, min_tokens, logprobs and penalties (their token counts stay on the
    # device: workers/device/penalty_counts.py) all reach the device without a sync.
    sampled = [
        SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True),
        SamplingParams(
            max_tokens=8,
            temperature=1.0,
            top_k=20,
            min_p=0.05,
            frequency_penalty=0.5,
            ignore_eos=True,
        ),
        SamplingParams(max_tokens=8, temperature=0.7, min_tokens=4, logprobs=3),
        SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True),
        SamplingParams(
            max_tokens=8,
            temperature=1.0,
            seed=9,
            repetition_penalty=1.2,
            presence_penalty=0.3,
            ignore_eos=True,
        ),
    ]
    ahead.clear()
    llm.generate(prompts, sampled, use_tqdm=False)
    assert max(ahead) >= 4
    llm.engine.shutdown()

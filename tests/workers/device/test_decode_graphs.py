"""Whole-step decode graphs of the triton backend. On CPU there is nothing to capture, but
everything else runs: decode steps padded to a capture size at the graphs' addresses, through
the same forward a graph replays, give transformers' greedy tokens."""

from __future__ import annotations

import random
from collections.abc import Iterator
from types import ModuleType

import pytest

from tests.triton_interpret import interpreted_kernels
from tests.workers.parity import assert_outputs_match_hf
from workers import LLM, SamplingParams
from workers.device.decode_graphs import FullGraphForward


@pytest.fixture(scope="module")
def kernels() -> Iterator[ModuleType]:
    yield from interpreted_kernels()


@pytest.mark.parametrize("kind", ["qwen3", "mistral"])
def test_padded_decode_steps_match_transformers(kernels: ModuleType, kind: str, checkpoints):
    path = checkpoints[kind]
    llm = LLM(
        str(path),
        kv_cache_memory_bytes=16 << 20,
        attention_backend="triton",
        compile=True,
        max_num_seqs=16,
        max_num_batched_tokens=48,
    )
    worker = llm.engine.executor.worker
    compiled = worker.forward.compiled
    assert isinstance(compiled, FullGraphForward)
    assert compiled.graphs.sizes == (1, 2, 4, 8, 16) and set(compiled.graphs.sets) == {
        1, 2, 4, 8, 16
    }  # fmt: skip
    rng = random.Random(1)
    vocab = llm.engine.vocab_size
    # Five sequences decode together (padded to 8); the long prompt's chunks over its cached
    # prefix run beside decodes, unpadded.
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 4, 16, 17, 70)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert compiled.graphs.replays > 0
    # One upload per step, whatever the step (and one per graph, for its capture).
    assert worker.step_buffers.uploads == worker.steps + len(compiled.graphs.sets)
    assert_outputs_match_hf(path, prompts, outs, 8)
    llm.engine.shutdown()


def test_a_failed_capture_leaves_every_step_eager(
    kernels: ModuleType, checkpoints, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    from workers.device.decode_graphs import FullDecodeGraphs

    def broken(*args, **kwargs) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(FullDecodeGraphs, "capture", broken)
    llm = LLM(
        str(checkpoints["qwen3"]),
        kv_cache_memory_bytes=16 << 20,
        attention_backend="triton",
        compile=True,
        max_num_seqs=4,
    )
    worker = llm.engine.executor.worker
    assert "capturing the decode graphs failed" in caplog.text
    assert worker.decode_padding is None and not worker.forward.compiled.graphs.sets
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    outs = llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 3 for o in outs)
    assert worker.forward.compiled.graphs.replays == 0
    llm.engine.shutdown()


def test_graphs_are_not_used_under_tensor_parallelism() -> None:
    from types import SimpleNamespace

    from workers.compile_config import CompilationConfig
    from workers.device.decode_graphs import full_graph_forward

    on = CompilationConfig(enabled=True)
    dense = SimpleNamespace(config=SimpleNamespace(moe=None))
    moe = SimpleNamespace(config=SimpleNamespace(moe=object()))
    assert full_graph_forward(CompilationConfig(), dense, 1, 8) is None
    assert full_graph_forward(on, dense, 2, 8) is None
    assert full_graph_forward(on, dense, 1, 8).graphs.sizes == (1, 2, 4, 8)
    # Mixture-of-experts models too: their experts run sync-free on this backend.
    assert full_graph_forward(on, moe, 1, 8) is not None

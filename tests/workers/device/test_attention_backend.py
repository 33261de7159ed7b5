"""The attention backend's choice, and the whole engine on the triton backend (its kernels on
CPU under Triton's interpreter) giving transformers' greedy tokens."""

from __future__ import annotations

import random
from collections.abc import Iterator
from types import ModuleType

import pytest

from tests.triton_interpret import interpreted_kernels, triton_available
from tests.workers.parity import assert_outputs_match_hf
from workers import LLM, SamplingParams
from workers.device.attention_backend import AttentionBackend


@pytest.fixture(scope="module")
def kernels() -> Iterator[ModuleType]:
    yield from interpreted_kernels()


def test_auto_is_torch_until_the_kernels_pass_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.device import attention_backend

    cpu = AttentionBackend.choose("auto", "cpu")
    assert cpu.name == "torch" and "cpu" in cpu.reason
    assert AttentionBackend.choose("torch", "cuda").name == "torch"
    cuda = AttentionBackend.choose("auto", "cuda")
    assert cuda.name == "torch"  # not yet validated on a GPU
    monkeypatch.setattr(attention_backend, "AUTO_PICKS_TRITON", True)
    cuda = AttentionBackend.choose("auto", "cuda")
    assert cuda.name == ("triton" if triton_available() else "torch")


def test_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if not triton_available():
        pytest.skip("triton is not installed")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        AttentionBackend.choose("triton", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert AttentionBackend.choose("triton", "cpu").name == "triton"


def test_unknown_backend_is_refused(checkpoints) -> None:
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(str(checkpoints["qwen3"]), attention_backend="flash")


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_engine_on_triton_matches_transformers(kernels: ModuleType, kind: str, checkpoints) -> None:
    """Prompts across block boundaries, a one-token prompt, and a token budget that splits the
    long prompts into chunks over a cached prefix, beside decodes in the same steps."""
    path = checkpoints[kind]
    llm = LLM(
        str(path),
        kv_cache_memory_bytes=16 << 20,
        attention_backend="triton",
        max_num_batched_tokens=48,
    )
    assert llm.engine.executor.worker.attention_backend.name == "triton"
    rng = random.Random(0)
    vocab = llm.engine.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 16, 17, 70)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_outputs_match_hf(path, prompts, outs, 6)

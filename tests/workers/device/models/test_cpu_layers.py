"""CpuLayers, the layers of a CPU step as direct kernel calls, against the modules they stand
in for: the same hidden states, bit for bit, on every step of a mixed workload."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
import torch

from tests.checkpoints import make_checkpoint
from workers import LLM, SamplingParams
from workers.device.layers.cpu_kernels import tiled_kernels
from workers.device.models.cpu_layers import CpuLayers


@pytest.fixture
def one_thread():
    """torch (and the kernels, which take torch's thread count) on one thread. With two,
    MKL's sgemm, which serves the BLAS's steps on both paths, is not bitwise reproducible from
    call to call once other GEMMs have run in the process: about 1 run in 4 after the kernel
    tests (tests/workers/device/layers) differed by up to 4e-3, none with MKL_CBWR=AVX512. CI runs
    every test on one thread (OMP_NUM_THREADS=1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(llm: LLM) -> Any:
    return llm.engine.executor.worker.model


def _recorded_run(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Every step's hidden states (after the last layer) while `llm` serves `prompts`."""
    model = _model(llm)
    steps: list[torch.Tensor] = []
    inner = model.logits

    def logits(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        steps.append(x.clone())
        return inner(x, indices)

    model.logits = logits
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    return steps


def _prompts(vocab: int) -> list[list[int]]:
    """Decodes, short chunks (rows of the decode kernel), long chunks (the prefill kernel),
    and chunks over a cached prefix (the shared 40 tokens, once the first request cached them)."""
    rng = random.Random(0)
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    fresh = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 5, 17, 64, 150)]
    return [shared + [5, 6, 7], *fresh, shared + [9] * 30, shared + [11] * 3]


@pytest.mark.parametrize(
    ("kind", "dtype"),
    [("qwen3", "float32"), ("qwen2", "float32"), ("qwen3", "bfloat16"), ("llama", "bfloat16")],
)
def test_same_hidden_states_as_the_modules(kind: str, dtype: str, tmp_path, one_thread) -> None:
    # qwen3: q/k norms; qwen2: q/k/v biases, k rotated in place in the fused projection;
    # float32 weights take the skinny kernel and the BLAS, bfloat16 ones the packed copies.
    path = make_checkpoint(kind, tmp_path / kind, dtype=dtype)
    # 48-token steps: prompts are chunked, and later chunks attend over the earlier ones.
    kwargs = dict(kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=48, max_num_seqs=8)
    direct, modules = LLM(str(path), **kwargs), LLM(str(path), **kwargs)
    runner = direct.engine.executor.worker.forward.direct
    assert isinstance(runner, CpuLayers)
    worker = modules.engine.executor.worker
    worker.forward = dataclasses.replace(worker.forward, direct=None)  # the modules' path
    calls = 0
    inner_run = runner.run

    def run(*args: Any) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return inner_run(*args)

    runner.run = run
    prompts = _prompts(direct.engine.vocab_size)
    ours, theirs = _recorded_run(direct, prompts), _recorded_run(modules, prompts)
    # Every step: the prefill kernel takes the chunks.
    assert tiled_kernels(runner.lib)  # kernels on: a build with 32-byte vectors or wider
    assert len(ours) > 10 and calls == len(ours)
    assert len(ours) == len(theirs)
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert torch.equal(a, b), f"step {step}: {a.shape} differs by {(a - b).abs().max()}"


def test_only_when_every_module_runs_through_the_kernels(checkpoints) -> None:
    llm = LLM(str(checkpoints["qwen3"]), kv_cache_memory_bytes=8 << 20)
    model = _model(llm)
    lib = llm.engine.executor.worker.cpu_kernel
    assert lib is not None and model.layers[0].input_layernorm.cpu_kernels is not None
    assert CpuLayers.from_model(model, lib) is not None
    assert CpuLayers.from_model(model, None) is None
    # A linear layer may keep torch's linear (float32 weights on a build without AVX-512).
    model.layers[-1].mlp.down_proj.cpu_kernels = None
    assert CpuLayers.from_model(model, lib) is not None
    model.layers[-1].post_attention_layernorm.cpu_kernels = None  # as for a tensor it cannot take
    assert CpuLayers.from_model(model, lib) is None

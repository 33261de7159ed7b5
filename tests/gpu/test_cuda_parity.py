"""TP=1 greedy parity with transformers on CUDA in float32 (run by tests/gpu/check.sh): eager;
compiled as by default (decode-only batches replay CUDA graphs of the torch.compile pieces,
other steps run eagerly, workers/device/compile.py); and with the pieces compiled for every step.
The triton backend eager, with whole-step decode graphs, and with async scheduling."""

from __future__ import annotations

import random

import pytest
import torch

from tests.checkpoints import KINDS, make_checkpoint
from tests.workers.parity import assert_greedy_match

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(
    ("compile", "min_tokens", "backend", "async_scheduling"),
    [
        (False, None, "torch", False),
        (True, None, "torch", False),
        (True, 0, "torch", False),
        (False, None, "triton", False),
        (True, None, "triton", False),
        (True, None, "triton", True),
    ],
    ids=["eager", "graphs", "every-step", "triton-eager", "triton-graphs", "triton-graphs-async"],
)
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_greedy_matches_transformers(
    kind: str,
    compile: bool,
    min_tokens: int | None,
    backend: str,
    async_scheduling: bool,
    tmp_path,
) -> None:
    if backend == "triton":
        pytest.importorskip("triton")
    from transformers import AutoModelForCausalLM

    from workers import LLM, SamplingParams

    path = make_checkpoint(kind, tmp_path / kind)
    # A fixed KV budget: the default (a share of free memory) would let the tests, which may
    # run side by side (pytest -n), starve each other.
    llm = LLM(
        str(path),
        dtype="float32",
        device="cuda",
        compile=compile,
        compile_min_tokens=min_tokens,
        kv_cache_memory_bytes=1 << 30,
        attention_backend=backend,  # workers/device/attention_backend.py
        # Decode steps read their last token from the device (workers/device/in_flight.py).
        async_scheduling=async_scheduling,
    )
    assert llm.engine.executor.worker.attention_backend.name == backend
    compiled = llm.engine.executor.worker.forward.compiled
    if compile:  # decode-only steps replay CUDA graphs, one set per capture size
        assert compiled is not None and compiled.graphs is not None and compiled.graphs.sets
    else:
        assert compiled is None
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 3800) for _ in range(n)] for n in (1, 17, 64, 129, 300)]
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False
    )
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt], device="cuda")
        ref = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=hf.config.vocab_size,
            pad_token_id=0,
        )
        assert_greedy_match(
            hf.cpu(), prompt, out.outputs[0].token_ids, ref[0, len(prompt) :].tolist()
        )
        hf.cuda()
    if compile:  # the decode steps (5 sequences, padded to 8) ran from the graphs
        assert compiled.graphs.replays > 0


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "graphs"])
def test_cuda_lora_mixed_batch_matches_merged_weights(compile: bool, tmp_path) -> None:
    """Base-model rows and two adapters in one batch on CUDA (float32): each equals
    transformers with peft's merged weights; base-only steps still replay CUDA graphs."""
    pytest.importorskip("peft")
    from tests.checkpoints import hf_greedy
    from tests.workers.lora.adapters import merged_hf_model, write_random_adapter
    from workers import LLM, SamplingParams
    from workers.lora import LoRARequest

    path = make_checkpoint("qwen2", tmp_path / "base")
    adapters = {
        name: write_random_adapter(path, tmp_path / name, rank=rank, seed=seed)
        for name, rank, seed in (("a1", 8, 1), ("a2", 16, 2))
    }
    llm = LLM(
        str(path),
        dtype="float32",
        device="cuda",
        compile=compile,
        kv_cache_memory_bytes=1 << 30,
        enable_lora=True,
        max_lora_rank=16,
    )
    rng = random.Random(1)
    prompts, loras = [], []
    for n in (1, 17, 64):
        p = [rng.randrange(3, 3800) for _ in range(n)]
        for i, name in enumerate((None, "a1", "a2")):
            prompts.append(p)
            loras.append(None if name is None else LoRARequest(name, i, str(adapters[name])))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    for prompt, lora, out in zip(prompts, loras, outs, strict=True):
        hf = merged_hf_model(path, adapters[lora.lora_name]) if lora else None
        if hf is None:
            from tests.checkpoints import load_hf

            hf = load_hf(path)
        assert_greedy_match(hf, prompt, out.outputs[0].token_ids, hf_greedy(hf, prompt, 12))


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_cuda_triton_experts_match_transformers(kind: str, compile: bool, tmp_path) -> None:
    """Mixture-of-experts models on the triton backend in float32: the experts as grouped
    GEMMs (workers/device/layers/triton_moe.py), eager and in whole-step decode graphs,
    against transformers on CUDA."""
    pytest.importorskip("triton")
    from tests.checkpoints import hf_greedy, load_hf
    from tests.moe_checkpoints import make_moe_checkpoint
    from workers import LLM, SamplingParams

    path = make_moe_checkpoint(kind, tmp_path / kind, num_experts=8, top_k=2)
    llm = LLM(
        str(path),
        dtype="float32",
        device="cuda",
        kv_cache_memory_bytes=1 << 30,
        attention_backend="triton",
        compile=compile,
    )
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 3800) for _ in range(n)] for n in (1, 17, 64, 300)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    hf = load_hf(path)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_greedy_match(hf, prompt, out.outputs[0].token_ids, hf_greedy(hf, prompt, 12))
    if compile:
        assert llm.engine.executor.worker.forward.compiled.graphs.replays > 0

"""Gemma 3 (Gemma3ForCausalLM): greedy tokens identical to transformers in float32, with the CPU
kernels on and off, batched, chunked, prefix-cached, preempted and compiled; prompt logprobs
and embeddings to 1e-4. The checkpoints (tests/gemma_checkpoints.py) mix sliding and global
layers with distinct rope bases; the controls below show that a wrong base, layer type or
attention scale changes the tokens, so these tests would catch one. TP = 2:
test_gemma_tensor_parallel.py."""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.checkpoints import hf_greedy, load_hf
from tests.gemma_checkpoints import GLOBAL_THETA, LOCAL_THETA, make_gemma_checkpoint
from tests.workers.parity import assert_greedy_match
from workers import LLM, SamplingParams
from workers.config import ModelConfig
from workers.pooling import Pooling

# name -> make_gemma_checkpoint arguments
MODELS: dict[str, dict[str, Any]] = {
    # layer_types [sliding, full, sliding, sliding], rope_parameters per type, GQA.
    "new-gqa": {},
    # sliding_window_pattern 3 over 4 layers ([s, s, f, s]), rope_local_base_freq; one KV
    # head (Gemma 3 1B's MQA); sharded.
    "old-mqa": {"spelling": "old", "num_kv_heads": 1, "sharded": True},
}
LENGTHS = [1, 2, 5, 15, 16, 17, 33, 64, 100, 129, 200]  # + 12 outputs: within the 256 window
MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma")
    return {name: make_gemma_checkpoint(root / name, **kw) for name, kw in MODELS.items()}


_HF: dict[Path, Any] = {}


def _hf(path: Path) -> Any:
    if path not in _HF:
        _HF[path] = load_hf(path)
    return _HF[path]


def _prompts(lengths: list[int] = LENGTHS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 3800) for _ in range(n)] for n in lengths]


def _assert_matches(path: Path, prompts: list[list[int]], outs: list[Any], slack: int = 1) -> None:
    hf = _hf(path)
    exact = 0
    for prompt, out in zip(prompts, outs, strict=True):
        ours = out.outputs[0].token_ids
        assert len(ours) == MAX_TOKENS
        exact += assert_greedy_match(hf, prompt, ours, hf_greedy(hf, prompt, MAX_TOKENS))
    assert exact >= len(prompts) - slack  # ties are rare: most prompts match exactly


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu_kernels", "torch"])
@pytest.mark.parametrize("name", MODELS)
def test_greedy_batch_matches_transformers(name: str, kernels: bool, models, caplog) -> None:
    path = models[name]
    with caplog.at_level(logging.INFO):
        llm = LLM(str(path), kv_cache_memory_bytes=16 << 20, cpu_kernels=kernels)
    assert llm.engine.max_model_len == 256  # the sliding window caps it (512 positions)
    worker = llm.engine.executor.worker
    if worker.cpu_kernel is not None:  # the modules run the kernels; no direct layer calls
        assert worker.forward.direct is None
        assert "Gemma 3 model: its layers run as modules" in caplog.text
        layer = worker.model.layers[0]
        assert layer.post_feedforward_layernorm.cpu_kernels is not None
        assert layer.self_attn.q_norm.cpu_kernels is not None
        assert worker.info()["forward"] == "kernels"
    prompts = _prompts()
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)  # ONE batch
    _assert_matches(path, prompts, outs)
    assert llm.stats().kv_blocks_used == 0
    llm.engine.shutdown()


@pytest.mark.parametrize("name", MODELS)
def test_chunked_prefill_prefix_caching_and_preemption(name: str, models) -> None:
    path = models[name]
    prefix = _prompts([48], seed=1)[0]
    prompts = [prefix + p for p in _prompts([5, 60, 120, 9, 33, 70], seed=2)]
    c = ModelConfig.from_pretrained(path)
    per_block = 2 * c.num_layers * 16 * c.num_kv_heads * c.head_dim * 4  # K and V, float32
    # 24 blocks of 16 tokens: fewer than the batch needs, so sequences are preempted; a
    # 32-token step budget splits every long prompt over several steps.
    llm = LLM(str(path), kv_cache_memory_bytes=24 * per_block, max_num_batched_tokens=32)
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    again = llm.generate(prompts[:2], GREEDY, use_tqdm=False)  # identical prompts: cached
    stats = llm.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert all(o.num_cached_tokens > 0 for o in again)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first[:2]]
    _assert_matches(path, prompts, first)
    assert stats.kv_blocks_used == 0
    llm.engine.shutdown()


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu_kernels", "torch"])
def test_prompt_logprobs_and_embeddings_match_transformers(kernels: bool, models) -> None:
    path = models["old-mqa"]
    llm = LLM(str(path), kv_cache_memory_bytes=16 << 20, cpu_kernels=kernels)
    prompts = _prompts([40, 150], seed=3)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
        with torch.no_grad():
            hf_out = _hf(path)(torch.tensor([prompt]), output_hidden_states=True)
        ref = torch.log_softmax(hf_out.logits[0].float(), dim=-1)
        lps = out.prompt_logprobs
        assert lps is not None and len(lps) == len(prompt) and lps[0] is None
        for i in range(1, len(prompt)):
            top = ref[i - 1].topk(3)
            want = dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
            want[prompt[i]] = ref[i - 1, prompt[i]].item()
            assert lps[i].keys() == want.keys(), (i, lps[i], want)
            for t, v in want.items():
                assert lps[i][t] == pytest.approx(v, abs=1e-4), (i, t)
        # The last token's final-norm hidden state (GemmaRMSNorm), L2-normalised.
        emb = llm.embed([prompt], Pooling("last"), use_tqdm=False)[0].embedding
        want_emb = torch.nn.functional.normalize(hf_out.hidden_states[-1][0, -1], dim=0)
        torch.testing.assert_close(torch.tensor(emb), want_emb, atol=1e-4, rtol=0)
    llm.engine.shutdown()


def test_compiled_forward_matches_transformers(models) -> None:
    # Both layer types share the two compiled graphs: each layer's rope is a graph input.
    path = models["new-gqa"]
    llm = LLM(str(path), kv_cache_memory_bytes=16 << 20, compile=True, compile_min_tokens=1)
    worker = llm.engine.executor.worker
    assert worker.forward.compiled is not None and worker.info()["forward"].endswith("+compiled")
    prompts = _prompts([3, 140, 200], seed=4)
    _assert_matches(path, prompts, llm.generate(prompts, GREEDY, use_tqdm=False), slack=0)
    llm.engine.shutdown()


def test_a_bfloat16_checkpoint_served_in_float32_matches_transformers(tmp_path) -> None:
    # Linears read packed bfloat16 copies where the kernels have them; the norms fold the
    # bfloat16 w into 1 + w in float32, as transformers computes it.
    path = make_gemma_checkpoint(tmp_path / "bf16", dtype="bfloat16")
    llm = LLM(str(path), kv_cache_memory_bytes=16 << 20, dtype="float32")
    prompts = _prompts(LENGTHS[::2], seed=5)
    _assert_matches(path, prompts, llm.generate(prompts, GREEDY, use_tqdm=False))
    llm.engine.shutdown()


def _edited(src: Path, dst: Path, edit: str) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    ropes = cfg["rope_parameters"]
    if edit == "local base = global":
        ropes["sliding_attention"]["rope_theta"] = GLOBAL_THETA
    elif edit == "global base = local":
        ropes["full_attention"]["rope_theta"] = LOCAL_THETA
    elif edit == "every layer global":
        cfg["layer_types"] = ["full_attention"] * len(cfg["layer_types"])
    elif edit == "head_dim scale":
        cfg["query_pre_attn_scalar"] = cfg["head_dim"]
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "edit", ["local base = global", "global base = local", "every layer global", "head_dim scale"]
)
def test_a_wrong_rope_layer_type_or_scale_fails_parity(edit: str, models, tmp_path) -> None:
    # The engine run on a config with one thing wrong, against transformers on the right one.
    path = models["new-gqa"]
    llm = LLM(str(_edited(path, tmp_path / "edited", edit)), kv_cache_memory_bytes=16 << 20)
    prompts = _prompts(LENGTHS[3:9], seed=6)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    llm.engine.shutdown()
    refs = [hf_greedy(_hf(path), p, MAX_TOKENS) for p in prompts]
    same = sum(o.outputs[0].token_ids == r for o, r in zip(outs, refs, strict=True))
    assert same <= len(prompts) // 2, f"{edit}: {same} of {len(prompts)} still match"


def test_the_triton_backends_fused_layers_match_transformers(models) -> None:
    """Gemma's four norms, scaled q and GeGLU through the triton backend's fused layers (CPU:
    Triton's interpreter, tests/conftest.py)."""
    pytest.importorskip("triton")
    path = models["new-gqa"]
    llm = LLM(
        str(path), kv_cache_memory_bytes=16 << 20, attention_backend="triton", cpu_kernels=False
    )
    assert llm.engine.executor.worker.model.triton_layers is not None
    prompts = _prompts([1, 5, 17, 40])
    _assert_matches(path, prompts, llm.generate(prompts, GREEDY, use_tqdm=False))

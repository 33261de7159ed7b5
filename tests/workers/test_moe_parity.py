"""Mixture-of-experts models (Qwen3-MoE, Mixtral): greedy tokens identical to transformers in
float32, across expert counts, top-k, renormalisation, dense layers among sparse ones, and
every engine path (batching, chunked prefill, prefix caching, preemption, CPU kernels on and
off, the compiled forward declining, prompt logprobs). TP = 2: test_moe_tensor_parallel.py."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tests.checkpoints import hf_greedy, hf_logprobs, load_hf
from tests.moe_checkpoints import make_moe_checkpoint
from tests.workers.parity import assert_greedy_match
from workers import LLM, SamplingParams
from workers.config import ModelConfig
from workers.device.layers.moe import SparseMoeBlock

# name -> (kind, make_moe_checkpoint arguments)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # layer 0 dense (mlp_only_layers), 1 and 2 sparse; top-k weights renormalised.
    "qwen3_moe-e4k2": ("qwen3_moe", {"num_layers": 3, "mlp_only_layers": (0,)}),
    # decoder_sparse_step 2: layers 1 and 3 sparse; top-1 of 8 with its raw probability.
    "qwen3_moe-e8k1": (
        "qwen3_moe",
        {
            "num_experts": 8,
            "top_k": 1,
            "num_layers": 4,
            "decoder_sparse_step": 2,
            "norm_topk_prob": False,
        },
    ),  # fmt: skip
    "qwen3_moe-e8k3": ("qwen3_moe", {"num_experts": 8, "top_k": 3, "norm_topk_prob": False}),
    "mixtral-e4k2": ("mixtral", {}),
    # Sharded: a layer's experts straddle the two files.
    "mixtral-e8k1": ("mixtral", {"num_experts": 8, "top_k": 1, "num_layers": 3, "sharded": True}),
}
LENGTHS = [1, 2, 5, 15, 16, 17, 33, 64, 100, 129, 200]
MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {
        name: make_moe_checkpoint(kind, root / name, **kw) for name, (kind, kw) in MODELS.items()
    }


_HF: dict[Path, Any] = {}


def _hf(path: Path) -> Any:
    if path not in _HF:
        _HF[path] = load_hf(path)
    return _HF[path]


def _prompts(vocab: int, lengths: list[int] = LENGTHS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


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
    worker = llm.engine.executor.worker
    # The sparse layers are the ones transformers builds as sparse blocks.
    ours = [isinstance(layer.mlp, SparseMoeBlock) for layer in worker.model.layers]
    theirs = [hasattr(layer.mlp, "experts") for layer in _hf(path).model.layers]
    assert ours == theirs and any(ours)
    if worker.cpu_kernel is not None:  # the MoE MLP declines the kernels, attention keeps them
        assert worker.forward.direct is None
        assert worker.model.layers[0].input_layernorm.cpu_kernels is not None
        assert "the MoE MLP runs on torch ops" in caplog.text
        assert worker.info()["forward"] == "kernels"
    prompts = _prompts(llm.engine.vocab_size)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)  # ONE batch
    _assert_matches(path, prompts, outs)
    assert llm.stats().kv_blocks_used == 0
    llm.engine.shutdown()


@pytest.mark.parametrize("name", ["qwen3_moe-e4k2", "mixtral-e8k1"])
def test_chunked_prefill_prefix_caching_and_preemption(name: str, models) -> None:
    path = models[name]
    prefix = _prompts(3800, [48], seed=1)[0]
    prompts = [prefix + p for p in _prompts(3800, [5, 60, 120, 9, 33, 70], seed=2)]
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


def test_prompt_logprobs_and_logprobs_match_transformers(models) -> None:
    path = models["qwen3_moe-e8k1"]
    llm = LLM(str(path), kv_cache_memory_bytes=16 << 20)
    prompt = _prompts(llm.engine.vocab_size, [40], seed=3)[0]
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=0, logprobs=0)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    with torch.no_grad():
        ref = torch.log_softmax(_hf(path)(torch.tensor([prompt])).logits[0].float(), dim=-1)
    want = [ref[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    got = [out.prompt_logprobs[i][prompt[i]] for i in range(1, len(prompt))]
    assert got == pytest.approx(want, abs=1e-4)
    comp = out.outputs[0]
    rows = hf_logprobs(_hf(path), prompt, comp.token_ids)
    assert [lp[t] for lp, t in zip(comp.logprobs, comp.token_ids, strict=True)] == pytest.approx(
        [row[t].item() for row, t in zip(rows, comp.token_ids, strict=True)], abs=1e-4
    )
    llm.engine.shutdown()


def test_compiled_forward_declines_and_serves_eagerly(models, caplog) -> None:
    path = models["mixtral-e4k2"]
    with caplog.at_level(logging.WARNING):
        llm = LLM(str(path), kv_cache_memory_bytes=16 << 20, compile=True, compile_min_tokens=1)
    worker = llm.engine.executor.worker
    assert worker.forward.compiled is None and "+compiled" not in worker.info()["forward"]
    assert "mixture-of-experts model runs the eager forward" in caplog.text
    prompts = _prompts(llm.engine.vocab_size, [3, 140], seed=4)
    _assert_matches(path, prompts, llm.generate(prompts, GREEDY, use_tqdm=False), slack=0)
    llm.engine.shutdown()


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_a_bfloat16_checkpoint_served_in_float32_matches_transformers(kind: str, tmp_path) -> None:
    # The attention's and dense layers' linears read packed bfloat16 copies where the kernels
    # have them; the experts stay float32 torch matmuls of the same values.
    kw = {"num_layers": 3, "mlp_only_layers": (1,)} if kind == "qwen3_moe" else {}
    path = make_moe_checkpoint(kind, tmp_path / kind, dtype="bfloat16", **kw)
    llm = LLM(str(path), kv_cache_memory_bytes=16 << 20, dtype="float32")
    prompts = _prompts(llm.engine.vocab_size, LENGTHS[::2], seed=5)
    _assert_matches(path, prompts, llm.generate(prompts, GREEDY, use_tqdm=False))
    llm.engine.shutdown()


def test_the_triton_backends_grouped_experts_match_transformers(models) -> None:
    """The triton backend's experts (workers/device/layers/triton_moe.py: grouped GEMMs that
    never sync with the host; CPU: Triton's interpreter, tests/conftest.py), with a dense
    layer among the sparse ones, in whole-step decode graphs (on CPU: the padded steps, run
    eagerly), and the experts' token counts without the padding rows (other routings:
    tests/workers/device/layers/test_triton_moe.py)."""
    pytest.importorskip("triton")
    path = models["qwen3_moe-e4k2"]
    llm = LLM(
        str(path),
        kv_cache_memory_bytes=16 << 20,
        attention_backend="triton",
        cpu_kernels=False,
        compile=True,
        max_num_seqs=8,
    )
    blocks = [
        m for m in llm.engine.executor.worker.model.modules() if isinstance(m, SparseMoeBlock)
    ]
    assert blocks and all(b.triton_layers is not None for b in blocks)
    prompts = _prompts(llm.engine.vocab_size, [1, 5, 17, 40, 3])
    _assert_matches(path, prompts, llm.generate(prompts, GREEDY, use_tqdm=False))
    top_k = blocks[0].top_k
    tokens = sum(len(p) for p in prompts) + len(prompts) * (MAX_TOKENS - 1)
    assert all(int(b.expert_tokens.sum()) == tokens * top_k for b in blocks)
    # The five sequences' decode steps replayed the graph of size 8: three padding rows each.
    assert llm.engine.executor.worker.forward.compiled.graphs.replays > 0
    llm.engine.shutdown()


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_both_transformers_spellings_load_and_match(kind: str, tmp_path: Path) -> None:
    """config.json hand-written as transformers 4.x saved it (Qwen3-MoE's `num_experts`,
    `rope_theta`) and as 5.x does (`num_local_experts`, `rope_parameters`): the same model,
    transformers' greedy tokens, 8 experts (not the family's default count)."""
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers 4.x does not read 5.x's spelling itself")
    tokens = {}
    for spelling in ("old", "new"):
        path = make_moe_checkpoint(
            kind, tmp_path / spelling, num_experts=8, config_spelling=spelling
        )
        assert ModelConfig.from_pretrained(path).moe.num_experts == 8
        llm = LLM(str(path), kv_cache_memory_bytes=16 << 20)
        prompts = _prompts(llm.engine.vocab_size, [3, 17, 40], seed=4)
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        _assert_matches(path, prompts, outs, slack=0)
        tokens[spelling] = [o.outputs[0].token_ids for o in outs]
        llm.engine.shutdown()
    assert tokens["old"] == tokens["new"]

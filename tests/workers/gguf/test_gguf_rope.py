"""Llama 3.1+ GGUF files: the `llama3` rope scaling read back from `rope_freqs.weight`
(workers/gguf/rope.py), and a Llama checkpoint with llama3 scaling, converted to GGUF as
llama.cpp converts it, served with transformers' greedy tokens and logprobs on the original
checkpoint (transformers' own GGUF loading ignores the factors, so it cannot be the oracle)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from tests.checkpoints import load_hf, make_checkpoint
from tests.gguf_checkpoints import hf_to_gguf, llama3_rope_factors
from tests.workers.parity import assert_greedy_and_logprobs_match
from workers import LLM, SamplingParams
from workers.config import ModelConfig
from workers.gguf.rope import llama3_from_factors

LLAMA_3_1 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
LLAMA_3_2 = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


@pytest.mark.parametrize(("params", "head_dim"), [(LLAMA_3_1, 128), (LLAMA_3_2, 64)])
def test_llama3_parameters_are_read_back_from_the_factors(params: dict, head_dim: int) -> None:
    rope = {**params, "original_max_position_embeddings": 8192}
    factors = llama3_rope_factors(500000.0, head_dim, rope)
    got = llama3_from_factors(factors, 500000.0, head_dim, "f")
    assert got == {"rope_type": "llama3", **rope}
    assert llama3_from_factors(np.ones(head_dim // 2), 500000.0, head_dim, "f") == {}


def test_factors_that_are_not_llama3_scaling_are_refused() -> None:
    noise = np.random.default_rng(0).uniform(1, 8, 64).astype(np.float32)
    with pytest.raises(ValueError, match="f: the RoPE frequency factors do not follow"):
        llama3_from_factors(noise, 500000.0, 128, "f")
    with pytest.raises(ValueError, match="expected head_dim / 2 = 64"):
        llama3_from_factors(np.ones(32), 500000.0, 128, "f")


@pytest.fixture(scope="module")
def llama31(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny Llama with llama3 rope scaling whose band of smoothed frequencies holds two of
    its 16 (head_dim 32): original_max_position_embeddings 256 (the parity checkpoints' 64
    leaves one, too few to read the scaling back)."""
    hf_dir = make_checkpoint("llama", tmp_path_factory.mktemp("llama31") / "hf")
    cfg = json.loads((hf_dir / "config.json").read_text())
    rope = cfg.get("rope_parameters") or cfg["rope_scaling"]
    assert rope["rope_type"] == "llama3"
    rope["original_max_position_embeddings"] = 256
    (hf_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return hf_dir, hf_to_gguf(hf_dir, hf_dir.parent / "llama31.gguf")


def test_a_llama_3_1_file_serves_as_its_checkpoint_does(llama31: tuple[Path, Path]) -> None:
    hf_dir, path = llama31
    rope = ModelConfig.from_pretrained(path).rope
    assert (rope.rope_type, rope.factor, rope.original_max_position_embeddings) == (
        "llama3",
        8.0,
        256,
    )
    assert (rope.low_freq_factor, rope.high_freq_factor, rope.theta) == (1.0, 4.0, 500000.0)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 3800) for _ in range(n)] for n in (3, 30, 90)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)
    llm = LLM(str(path), kv_cache_memory_bytes=16 << 20)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert_greedy_and_logprobs_match(load_hf(hf_dir), prompts, outs, 10)

"""Speculative decoding at TP = 2 (the ranks compute the verifying chunk in lockstep; rank 0
samples every position) and through the triton attention backend (CPU: its interpreter)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.workers.spec_decode.oracle import OracleProposer, reference_of
from workers import LLM, SamplingParams

FIXED = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
PARAMS = [
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=1.0, seed=11, ignore_eos=True),
]


def _same_with_oracle(path: Path, prompts: list[list[int]], **kwargs: object) -> None:
    plain = LLM(str(path), kv_cache_memory_bytes=16 << 20)
    spec = LLM(str(path), kv_cache_memory_bytes=16 << 20, speculative_config=FIXED, **kwargs)
    try:
        for params in PARAMS:
            ref = plain.generate(prompts, params, use_tqdm=False)
            oracle = OracleProposer(reference_of(ref), spec.engine.vocab_size)
            spec.engine.speculator.proposer = oracle
            out = spec.generate(prompts, params, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in out] == [r.outputs[0].token_ids for r in ref]
        st = spec.stats()
        assert 0 < st.spec_decode_accepted_tokens < st.spec_decode_draft_tokens
        assert st.kv_blocks_used == 0
    finally:
        plain.engine.shutdown()
        spec.engine.shutdown()


PROMPTS = [[3, 17, 29, 41], [100, 7, 7, 300, 12, 5, 9], list(range(40, 110))]


def test_tp2_verifies_drafts_as_tp1_decodes(ray_session: object, checkpoints) -> None:  # noqa: ANN001
    _same_with_oracle(checkpoints["qwen3"], PROMPTS, tensor_parallel_size=2)


def test_the_triton_backend_verifies_drafts(checkpoints) -> None:  # noqa: ANN001
    pytest.importorskip("triton")
    _same_with_oracle(checkpoints["llama"], PROMPTS, attention_backend="triton", cpu_kernels=False)

"""Unseeded sampling with speculation has the model's distribution: a two-sample chi-squared
test over 10^4 sampled continuations cannot tell it from plain sampling (and does tell a
distribution that was changed on purpose)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from workers import LLM, SamplingParams
from workers.core.request import Seq
from workers.core.speculator import SeqSpeculation

SAMPLES = 10_000
# top_k = 3 at temperature 1: each of the 3 positions has at most 3 tokens, 27 outcomes.
PARAMS = SamplingParams(max_tokens=3, temperature=1.0, top_k=3, ignore_eos=True, n=100)


class ConstantDraft:
    """Proposes `token` for the second output whatever the first was: accepted when the model
    samples it, rejected otherwise; the third output is then the verifying step's bonus."""

    def __init__(self, token: int) -> None:
        self.token = token

    def propose_batch(self, asks: list[tuple[Seq, SeqSpeculation, int]]) -> list[list[int]]:
        return [[self.token][:k] for _, _, k in asks]


def _outcomes(llm: LLM, prompt: list[int]) -> Counter:
    outs = llm.generate([prompt] * (SAMPLES // PARAMS.n), PARAMS, use_tqdm=False)
    return Counter(tuple(c.token_ids) for o in outs for c in o.outputs)


def _chi2(a: Counter, b: Counter) -> tuple[float, int]:
    """Two-sample chi-squared statistic over the union of outcomes (equal sample sizes)."""
    keys = set(a) | set(b)
    stat = sum((a[k] - b[k]) ** 2 / (a[k] + b[k]) for k in keys)
    return stat, len(keys) - 1


def test_speculative_sampling_has_the_plain_distribution(demo_dir: Path) -> None:
    from scipy.stats import chi2

    prompt = [20, 31, 47, 59]
    plain = LLM(str(demo_dir), kv_cache_memory_bytes=64 << 20, max_num_seqs=256)
    fixed = {"method": "ngram", "num_speculative_tokens": 1, "adaptive": False}
    spec = LLM(
        str(demo_dir), kv_cache_memory_bytes=64 << 20, max_num_seqs=256, speculative_config=fixed
    )
    try:
        base = _outcomes(plain, prompt)
        # The draft: the commonest second token, so that drafts are often accepted.
        second = Counter(k[1] for k in base.elements()).most_common(1)[0][0]
        spec.engine.speculator.proposer = ConstantDraft(second)
        ours = _outcomes(spec, prompt)
        st = spec.stats()
        assert st.spec_decode_drafts == SAMPLES  # every sequence verified one draft
        assert 0 < st.spec_decode_accepted_tokens < SAMPLES
        stat, df = _chi2(base, ours)
        assert chi2.sf(stat, df) > 1e-4, (stat, df)
        # The test can fail: always keeping the draft (no verification) is told apart.
        forced: Counter = Counter()
        for k, n in ours.items():
            forced[(k[0], second, k[2])] += n
        stat, df = _chi2(base, forced)
        assert chi2.sf(stat, df) < 1e-6
    finally:
        plain.engine.shutdown()
        spec.engine.shutdown()

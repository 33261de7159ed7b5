"""The sampler against hand-computed references: exact penalties and logprobs, chi-square fits
of the sampled distributions, and seeded streams that ignore batch composition and preemption."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from workers.layers.sampler import (
    Sampler,
    SamplerOutput,
    SamplingBatch,
    apply_filters,
    apply_penalties,
    logprobs_to_dicts,
)
from workers.sampling_params import SamplingParams

# A fixed, well-spread distribution over a small vocabulary for the goodness-of-fit tests.
FIT_LOGITS = np.array(
    [2.0, 1.6, 1.3, 1.0, 0.7, 0.4, 0.1, -0.2, -0.6, -1.0, -1.4, -1.9], dtype=np.float32
)
FIT_SAMPLES = 20_000
P_VALUE_FLOOR = 1e-4

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def build(
    params: list[SamplingParams],
    vocab_size: int,
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    device: str = "cpu",
    **kwargs: object,
) -> SamplingBatch:
    outputs = outputs if outputs is not None else [[] for _ in params]
    prompts = prompts if prompts is not None else [[] for _ in params]
    return SamplingBatch.build(
        params, prompts, outputs, device=device, vocab_size=vocab_size, **kwargs
    )


def sample(
    logits: torch.Tensor, params: list[SamplingParams], seed: int = 0, **kwargs: object
) -> SamplerOutput:
    return Sampler(seed)(
        logits, build(params, logits.shape[-1], device=str(logits.device), **kwargs)
    )


def reference_keep(
    z: np.ndarray, top_k: int, top_p: float, min_p: float, margin: float = 1e-3
) -> np.ndarray:
    """Which tokens of temperature-scaled logits `z` survive top-k, top-p and min-p, in float64.

    Cuts are by value (a tie with the last survivor survives), so top-p keeps whole groups of
    equal logits. Each rule's margin is checked so that float32 rounding in the sampler cannot
    flip a token in or out.
    """
    z = z.astype(np.float64)
    keep = np.ones(z.shape, dtype=bool)
    if top_k > 0:
        keep &= z >= np.sort(z)[::-1][top_k - 1]

    def renormalised() -> np.ndarray:
        p = np.where(keep, np.exp(z - z.max()), 0.0)
        return p / p.sum()

    if top_p < 1.0:
        p = renormalised()
        groups = np.unique(z[keep])[::-1]  # distinct surviving logits, descending
        group_mass = np.array([p[z == v].sum() for v in groups])
        mass_before = np.cumsum(group_mass) - group_mass
        assert np.min(np.abs(mass_before - top_p)) > margin, "top_p too close to a boundary"
        keep &= z >= groups[mass_before < top_p].min()
    if min_p > 0.0:
        p = renormalised()
        floor = min_p * p.max()
        assert np.min(np.abs(p[keep] - floor)) > margin / 10, "min_p too close to a boundary"
        keep &= p >= floor
    return keep


def target_distribution(
    logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float
) -> np.ndarray:
    """The distribution the sampler must draw from, in float64."""
    z = logits.astype(np.float64) / temperature
    keep = reference_keep(z, top_k, top_p, min_p)
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    return p / p.sum()


def draw_counts(params: list[SamplingParams], seed: int = 0) -> np.ndarray:
    logits = torch.from_numpy(FIT_LOGITS).expand(len(params), -1).contiguous()
    tokens = sample(logits, params, seed=seed).token_ids
    return np.bincount(tokens.numpy(), minlength=len(FIT_LOGITS))


def assert_fits(counts: np.ndarray, expected: np.ndarray) -> None:
    support = expected > 0
    assert counts[~support].sum() == 0, f"drew tokens outside the support: {counts}"
    assert (expected[support] * counts.sum() >= 5).all(), "expected cell counts too small"
    fit = chisquare(counts[support], expected[support] * counts.sum())
    assert fit.pvalue > P_VALUE_FLOOR, (fit, counts, expected)


# ---------------------------------------------------------------------------------- greedy


def test_greedy_rows_take_argmax_with_ties_to_lowest_id() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 37, generator=gen)
    logits[5] = 0.0
    logits[5, 9] = logits[5, 3] = 4.0  # a tie: torch.argmax's rule gives the lower id
    out = sample(logits, [SamplingParams(temperature=0.0)] * 64)
    assert out.logprobs is None and out.logprob_token_ids is None
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids[5].item() == 3


def test_top_k_one_equals_greedy() -> None:
    logits = torch.randn(50, 1000, generator=torch.Generator().manual_seed(2))
    out = sample(logits, [SamplingParams(temperature=1.3, top_k=1)] * 50, seed=7)
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_greedy_rows_in_a_mixed_batch_still_take_argmax() -> None:
    logits = torch.randn(40, 200, generator=torch.Generator().manual_seed(3)) * 0.3
    params = [
        SamplingParams(temperature=0.0) if i % 2 else SamplingParams(temperature=1.0, top_p=0.9)
        for i in range(40)
    ]
    tokens = sample(logits, params).token_ids
    argmax = logits.argmax(-1)
    assert torch.equal(tokens[1::2], argmax[1::2])
    # The random rows are near-uniform over 200 tokens: they must not all be the argmax.
    assert not torch.equal(tokens[0::2], argmax[0::2])


# --------------------------------------------------------------------------- distributions

FIT_CASES = {
    "temperature_low": dict(temperature=0.7),
    "temperature_high": dict(temperature=1.6),
    "top_k": dict(temperature=1.0, top_k=4),
    "top_p": dict(temperature=1.0, top_p=0.6),
    "min_p": dict(temperature=1.0, min_p=0.15),
    "all_filters": dict(temperature=0.8, top_k=7, top_p=0.85, min_p=0.05),
}


@pytest.mark.parametrize("case", list(FIT_CASES))
def test_unseeded_samples_follow_the_target_distribution(case: str) -> None:
    options = FIT_CASES[case]
    expected = target_distribution(
        FIT_LOGITS,
        options.get("temperature", 1.0),
        options.get("top_k", -1),
        options.get("top_p", 1.0),
        options.get("min_p", 0.0),
    )
    counts = draw_counts([SamplingParams(**options)] * FIT_SAMPLES, seed=11)
    assert_fits(counts, expected)


def test_seeded_rows_follow_the_target_distribution() -> None:
    # Every row its own seed: the per-(seed, position) streams must be as random as the shared one.
    options = dict(temperature=0.9, top_k=9, top_p=0.9)
    expected = target_distribution(FIT_LOGITS, 0.9, 9, 0.9, 0.0)
    params = [SamplingParams(seed=s, **options) for s in range(FIT_SAMPLES)]
    assert_fits(draw_counts(params), expected)


def test_rows_with_and_without_filters_share_a_batch() -> None:
    # The filtered rows make the sampler look only at their 3 best tokens; the plain rows in
    # the same batch must still draw from the whole vocabulary.
    half = FIT_SAMPLES // 2
    params = [SamplingParams(top_k=3, top_p=0.8)] * half + [SamplingParams()] * half
    logits = torch.from_numpy(FIT_LOGITS).expand(2 * half, -1).contiguous()
    tokens = sample(logits, params, seed=13).token_ids.numpy()
    filtered = target_distribution(FIT_LOGITS, 1.0, 3, 0.8, 0.0)
    plain = target_distribution(FIT_LOGITS, 1.0, -1, 1.0, 0.0)
    assert_fits(np.bincount(tokens[:half], minlength=len(FIT_LOGITS)), filtered)
    assert_fits(np.bincount(tokens[half:], minlength=len(FIT_LOGITS)), plain)


@pytest.mark.parametrize("options", [dict(top_k=2), dict(top_p=0.45)], ids=["top_k", "top_p"])
def test_tokens_tied_with_the_last_survivor_survive(options: dict[str, float]) -> None:
    # Both filters cut by value, so a tie is never split by however a sort orders it (which
    # could differ with the batch). Here either cut falls inside the group of three 1.0s.
    raw = np.array([2.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0], dtype=np.float32)
    logits = torch.from_numpy(raw).expand(4000, -1).contiguous()
    counts = np.bincount(
        sample(logits, [SamplingParams(**options)] * 4000, seed=4).token_ids.numpy(), minlength=8
    )
    expected = target_distribution(raw, 1.0, options.get("top_k", -1), options.get("top_p", 1), 0)
    assert (expected[1:4] > 0).all() and (expected[4:] == 0).all()
    assert_fits(counts, expected)


def test_filters_on_a_large_vocabulary_match_the_reference() -> None:
    # Beyond _TOP_P_PROBE tokens, a top-p row without top-k first looks at the best 1024 only:
    # row 0 (peaked) finds its mass there, row 1 (flat) does not and needs the full sort.
    vocab = 3000
    gen = torch.Generator().manual_seed(14)
    levels = torch.randint(0, 40, (5, vocab), generator=gen).float()
    logits = torch.stack(
        [levels[0] / 4, levels[1] / 100, levels[2] / 8, levels[3] / 8, levels[4] / 8]
    )
    options = [
        dict(temperature=1.0, top_p=0.9),
        dict(temperature=0.8, top_p=0.9),
        dict(temperature=1.0, top_k=40, top_p=0.8),
        dict(temperature=0.7),
        dict(temperature=1.5, min_p=0.3),
    ]
    batch = build([SamplingParams(**o) for o in options], vocab)
    assert batch.candidates < vocab and batch.top_p_probe
    got = apply_filters(logits, batch)
    for row, o in enumerate(options):
        z = logits[row].double().numpy() / o["temperature"]
        keep = reference_keep(z, o.get("top_k", -1), o.get("top_p", 1.0), o.get("min_p", 0.0), 1e-4)
        assert (torch.isfinite(got[row]).numpy() == keep).all(), row
        np.testing.assert_allclose(got[row].numpy()[keep], z[keep], rtol=1e-6)
    kept = [int(torch.isfinite(got[row]).sum()) for row in range(2)]
    assert kept[0] < 1024 < kept[1]  # both top-p paths really ran


def test_one_seed_across_positions_follows_the_target_distribution() -> None:
    # One seeded request's successive tokens (position = tokens generated so far) must be fresh
    # draws, not one draw repeated; the tokens themselves are irrelevant to unpenalised rows.
    positions = 2000
    expected = target_distribution(FIT_LOGITS, 1.0, -1, 1.0, 0.0)
    logits = torch.from_numpy(FIT_LOGITS).expand(positions, -1).contiguous()
    params = [SamplingParams(temperature=1.0, seed=77)] * positions
    outputs = [[0] * n for n in range(positions)]
    tokens = Sampler(0)(logits, build(params, len(FIT_LOGITS), outputs=outputs)).token_ids
    assert_fits(np.bincount(tokens.numpy(), minlength=len(FIT_LOGITS)), expected)


def test_chi_square_check_rejects_a_wrong_distribution() -> None:
    # Guards the guard: samples at temperature 0.7 must not pass as temperature 1.0.
    counts = draw_counts([SamplingParams(temperature=0.7)] * FIT_SAMPLES, seed=5)
    wrong = target_distribution(FIT_LOGITS, 1.0, -1, 1.0, 0.0)
    assert chisquare(counts, wrong * counts.sum()).pvalue < P_VALUE_FLOOR


# ------------------------------------------------------------------------------- penalties


def penalised_reference(
    logits: np.ndarray,
    params: list[SamplingParams],
    prompts: list[list[int]],
    outputs: list[list[int]],
) -> np.ndarray:
    out = logits.astype(np.float32).copy()
    for row, (p, prompt, output) in enumerate(zip(params, prompts, outputs, strict=True)):
        x = out[row]
        counts = np.bincount(np.array(output, dtype=np.int64), minlength=len(x)).astype(np.float32)
        seen = counts > 0
        seen[prompt] = True
        rp = np.float32(p.repetition_penalty)
        x[:] = np.where(seen, np.where(x > 0, x / rp, x * rp), x)
        x -= np.float32(p.frequency_penalty) * counts
        x -= np.float32(p.presence_penalty) * (counts > 0)
    return out


PENALTY_PROMPTS = [[1, 2, 3], [4, 4], [0, 5, 6], [7, 8, 1]]
PENALTY_OUTPUTS = [[3, 9, 9], [4, 10, 10, 10, 11], [12], [1, 1, 13, 14, 8]]


@pytest.mark.parametrize("every_row_penalised", [False, True])
def test_penalties_change_logits_exactly_as_defined(every_row_penalised: bool) -> None:
    vocab = 16
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(4)) * 2
    params = [
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(frequency_penalty=0.7, presence_penalty=0.3),
        SamplingParams(presence_penalty=-0.5) if every_row_penalised else SamplingParams(),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.2, presence_penalty=1.1),
    ]
    batch = build(params, vocab, outputs=PENALTY_OUTPUTS, prompts=PENALTY_PROMPTS)
    assert (batch.penalty_rows is None) == every_row_penalised
    got = apply_penalties(logits, batch).numpy()
    want = penalised_reference(logits.numpy(), params, PENALTY_PROMPTS, PENALTY_OUTPUTS)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert not np.allclose(want, logits.numpy())  # the reference really did penalise
    if not every_row_penalised:
        assert torch.equal(torch.from_numpy(got[2]), logits[2])


def test_greedy_choice_follows_the_penalised_logits() -> None:
    vocab = 16
    logits = torch.zeros(2, vocab)
    logits[:, 5] = 3.0  # best raw token, repeated in the output
    logits[:, 6] = 2.0
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.6), SamplingParams(temperature=0)]
    tokens = sample(logits, params, outputs=[[5, 5], [5, 5]]).token_ids
    assert tokens.tolist() == [6, 5]  # 3 - 2 * 0.6 < 2 for the penalised row only


# -------------------------------------------------------------------------------- seeding


def run_steps(
    sampler: Sampler,
    rows: list[SamplingParams],
    target: int,
    target_logits: list[torch.Tensor],
    start: int,
    steps: int,
    target_output: list[int],
) -> list[int]:
    """Generate `steps` tokens for row `target` among `rows`, feeding every row's tokens back."""
    vocab = target_logits[0].shape[-1]
    outputs = [[] for _ in rows]
    outputs[target] = list(target_output)
    noise = torch.Generator().manual_seed(len(rows))
    prompts = [[r % vocab, (7 * r) % vocab] for r in range(len(rows))]
    produced = []
    for step in range(start, start + steps):
        logits = torch.randn(len(rows), vocab, generator=noise) * 0.5
        logits[target] = target_logits[step]
        batch = build(rows, vocab, outputs=outputs, prompts=prompts)
        tokens = sampler(logits, batch).token_ids.tolist()
        for out, tok in zip(outputs, tokens, strict=True):
            out.append(tok)
        produced.append(tokens[target])
    return produced


SEEDED_TARGETS = {
    "top_p_and_penalty": dict(temperature=1.0, top_p=0.95, repetition_penalty=1.1),
    "top_k_top_p_min_p": dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02),
}


@pytest.mark.parametrize("target_name", list(SEEDED_TARGETS))
def test_seeded_row_ignores_batch_composition_and_preemption(target_name: str) -> None:
    vocab, steps = 500, 12
    gen = torch.Generator().manual_seed(8)
    # Logits rounded to 0.1 are full of ties, as low-precision models produce: which tied
    # tokens survive top-k/top-p must not depend on the batch either.
    target_logits = [(torch.randn(vocab, generator=gen) * 5).round() / 10 for _ in range(steps)]
    options = SEEDED_TARGETS[target_name]
    target = SamplingParams(seed=1234, **options)

    alone = run_steps(Sampler(0), [target], 0, target_logits, 0, steps, [])

    kinds = [
        SamplingParams(temperature=0.8, seed=7),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=5, min_p=0.1, seed=9),
        SamplingParams(top_p=0.5, presence_penalty=1.0, logprobs=3),  # forces a full sort
        SamplingParams(temperature=1.2, frequency_penalty=0.5, min_tokens=4),
    ]
    others = [kinds[i % len(kinds)] for i in range(32)]
    rows = others[:17] + [target] + others[17:]
    in_batch = run_steps(Sampler(99), rows, 17, target_logits, 0, steps, [])
    assert in_batch == alone

    # Preempted after 6 tokens, then recomputed in a different batch by a different engine seed.
    rows = [target] + others[:4]
    resumed = run_steps(Sampler(5), rows, 0, target_logits, 6, steps - 6, alone[:6])
    assert resumed == alone[6:]

    other_seed = SamplingParams(seed=1235, **options)
    assert run_steps(Sampler(0), [other_seed], 0, target_logits, 0, steps, []) != alone


def test_unseeded_rows_reproduce_under_the_same_engine_seed() -> None:
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(9)) * 0.5
    params = [SamplingParams(temperature=1.0)] * 16
    first = sample(logits, params, seed=21).token_ids
    assert torch.equal(first, sample(logits, params, seed=21).token_ids)
    assert not torch.equal(first, sample(logits, params, seed=22).token_ids)


# ------------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax_with_chosen_token_first() -> None:
    vocab = 40
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(10)) * 3
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=0.5, logprobs=1, repetition_penalty=2.0),
        SamplingParams(temperature=1.0, top_k=3, logprobs=5, seed=3),
        SamplingParams(temperature=1.0, frequency_penalty=1.5, logprobs=20),
        SamplingParams(temperature=1.0, min_tokens=5, eos_token_ids=(0,), logprobs=2),
    ]
    outputs = [[1], [2], [3, 3], [4], [5, 5, 5], [6]]
    batch = build(params, vocab, outputs=outputs, prompts=[[7, 8]] * 6)
    out = Sampler(0)(logits, batch)
    assert out.logprobs is not None and out.logprob_token_ids is not None
    assert out.logprobs.shape == out.logprob_token_ids.shape == (6, 21)

    reference = torch.log_softmax(logits.double(), -1).numpy()  # the model's distribution
    tokens = out.token_ids.numpy()
    got = out.logprobs.numpy()
    ids = out.logprob_token_ids.numpy()
    assert (ids[:, 0] == tokens).all()
    np.testing.assert_allclose(got[:, 0], reference[np.arange(6), tokens], atol=1e-6)
    np.testing.assert_allclose(got[:, 1:], np.sort(reference, -1)[:, ::-1][:, :20], atol=1e-6)
    np.testing.assert_allclose(got[:, 1:], np.take_along_axis(reference, ids[:, 1:], -1), atol=1e-6)
    assert (np.diff(got[:, 1:], axis=-1) <= 0).all()

    dicts = logprobs_to_dicts(out, batch)
    assert dicts[0] is None
    assert dicts[1] == {int(tokens[1]): pytest.approx(reference[1, tokens[1]], abs=1e-6)}
    top5 = np.argsort(-reference[3])[:5]
    assert set(dicts[3]) == set(top5.tolist()) | {int(tokens[3])}
    for token_id, value in dicts[3].items():
        assert value == pytest.approx(reference[3, token_id], abs=1e-6)


def test_no_logprobs_requested_means_none_returned() -> None:
    out = sample(torch.randn(3, 10), [SamplingParams(temperature=1.0)] * 3)
    assert out.logprobs is None and out.logprob_token_ids is None
    assert logprobs_to_dicts(out, build([SamplingParams()] * 3, 10)) == [None] * 3


# ----------------------------------------------------------------------------- min_tokens

EOS, STOP, NEXT = 2, 5, 7


def min_tokens_logits(rows: int) -> torch.Tensor:
    logits = torch.zeros(rows, 10)
    logits[:, EOS], logits[:, STOP], logits[:, NEXT] = 9.0, 8.0, 7.0
    return logits


@pytest.mark.parametrize("generated", [0, 1, 2, 3])
def test_min_tokens_blocks_eos_and_stop_ids_until_reached(generated: int) -> None:
    params = SamplingParams(
        temperature=0.0, min_tokens=3, eos_token_ids=(EOS,), stop_token_ids=[STOP, 99]
    )  # 99 is outside the vocabulary: it can never be sampled and must not break blocking
    ignoring_eos = SamplingParams(
        temperature=0.0, min_tokens=3, ignore_eos=True, eos_token_ids=(EOS,), stop_token_ids=[STOP]
    )
    outputs = [[NEXT] * generated] * 2
    tokens = sample(min_tokens_logits(2), [params, ignoring_eos], outputs=outputs).token_ids
    if generated < 3:
        assert tokens.tolist() == [NEXT, EOS]  # ignore_eos: EOS is no stop, so nothing to block
    else:
        assert tokens.tolist() == [EOS, EOS]


def test_min_tokens_holds_for_random_rows_and_explicit_block_lists() -> None:
    rows = 2000
    params = [SamplingParams(temperature=2.0, min_tokens=1, eos_token_ids=(EOS,))] * rows
    tokens = sample(min_tokens_logits(rows), params, seed=3).token_ids
    assert (tokens != EOS).all()
    assert (tokens == STOP).any()  # blocking only the EOS id leaves the stop id reachable

    explicit = [[EOS, STOP]] * rows
    tokens = sample(min_tokens_logits(rows), params, blocked_token_ids=explicit).token_ids
    assert ((tokens != EOS) & (tokens != STOP)).all()


# -------------------------------------------------------------------------------- devices


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outputs_live_on_the_logits_device(device: str, dtype: torch.dtype) -> None:
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(12)).to(device, dtype)
    params = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=1.0, top_k=8, top_p=0.9, min_p=0.05, seed=1),
        SamplingParams(temperature=0.7, repetition_penalty=1.2, min_tokens=2, eos_token_ids=(0,)),
        SamplingParams(temperature=1.0, frequency_penalty=0.4),
    ]
    batch = build(params, 64, outputs=[[1], [2], [3], [4, 4]], device=device)
    out = Sampler(0)(logits, batch)
    for tensor in out:
        assert tensor is not None and tensor.device == logits.device
    assert out.token_ids.dtype == torch.long and out.token_ids.shape == (4,)
    assert out.token_ids[0].item() == logits[0].float().argmax().item()

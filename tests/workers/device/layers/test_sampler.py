"""The sampler against hand-computed references: greedy choice, chi-square fits of the sampled
distributions, seeded streams that ignore batch composition and preemption, exact logprobs.
Penalties and filters: test_logits_processors.py; min_tokens blocking: test_sampling_batch.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from tests.workers.device.layers.sampling_helpers import (
    DEVICES,
    FIT_LOGITS,
    FIT_SAMPLES,
    P_VALUE_FLOOR,
    assert_fits,
    build,
    draw_counts,
    sample,
    target_distribution,
)
from workers.device.layers.sampler import Sampler, SamplerOutput, logprobs_to_dicts
from workers.sampling_params import SamplingParams

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


def test_a_top_p_below_float32s_range_keeps_the_top_token() -> None:
    # Found by the API fuzz tests: top_p=5e-324 is 0.0 as float32, the top-p filter kept no
    # token and indexed -1 (an IndexError that failed the engine step).
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(4))
    out = sample(logits, [SamplingParams(temperature=1.0, top_p=5e-324)] * 8)
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


@pytest.mark.parametrize("device", DEVICES)
def test_results_reach_the_host_in_one_copy_bit_for_bit(device: str) -> None:
    values = torch.tensor([[-0.5, -0.25, float("-inf")], [-1e-30, float("nan"), -88.7]])
    ids = torch.tensor([[7, 3, 1], [2, 9, 4]])
    out = SamplerOutput(torch.tensor([7, 2]), values, ids)
    on_device = SamplerOutput(*(t.to(device) for t in out))
    host = on_device.packed_to_host()
    assert all(t.device.type == "cpu" for t in host)
    assert host.token_ids.tolist() == [7, 2] and host.logprob_token_ids.equal(ids)
    assert host.logprobs.view(torch.int32).equal(values.view(torch.int32))
    assert on_device.to_host().logprobs.view(torch.int32).equal(values.view(torch.int32))
    plain = SamplerOutput(torch.tensor([5]).to(device), None, None).to_host()
    assert plain.token_ids.tolist() == [5] and plain.logprobs is None
    # Started without waiting (pinned memory and an event on CUDA), read after wait().
    started = on_device.start_to_host().wait()
    assert started.token_ids.tolist() == [7, 2] and started.logprob_token_ids.equal(ids)
    assert started.logprobs.view(torch.int32).equal(values.view(torch.int32))


def test_no_logprobs_requested_means_none_returned() -> None:
    out = sample(torch.randn(3, 10), [SamplingParams(temperature=1.0)] * 3)
    assert out.logprobs is None and out.logprob_token_ids is None
    assert logprobs_to_dicts(out, build([SamplingParams()] * 3, 10)) == [None] * 3


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

"""Penalties and filters on the logits, exactly as defined: against a float64 reference, with
ties, on a vocabulary large enough for the top-p probe to fall back to a full sort."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.workers.device.layers.sampling_helpers import (
    assert_fits,
    build,
    reference_keep,
    sample,
    target_distribution,
)
from workers.device.layers.logits_processors import apply_filters, apply_penalties
from workers.sampling_params import SamplingParams

# --------------------------------------------------------------------------------- filters


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


# ------------------------------------------------------------------------- grammar bitmask


def _pack(allowed: np.ndarray) -> torch.Tensor:
    """[G, V] bool -> [G, ceil(V / 32)] int32, bit t % 32 of word t // 32 (llguidance's)."""
    g, v = allowed.shape
    padded = np.zeros((g, -(-v // 32) * 32), dtype=bool)
    padded[:, :v] = allowed
    return torch.from_numpy(np.packbits(padded, axis=1, bitorder="little").view(np.int32).copy())


@pytest.mark.parametrize("vocab", [31, 64, 100])
def test_token_bitmask_masks_only_constrained_rows_and_disallowed_tokens(vocab: int) -> None:
    from workers.device.layers.logits_processors import apply_token_bitmask
    from workers.device.layers.sampling_batch import SamplingBatch

    rng = np.random.default_rng(vocab)
    logits = torch.from_numpy(rng.normal(size=(4, vocab)).astype(np.float32))
    allowed = rng.random((2, vocab)) < 0.3
    allowed[:, vocab - 1] = True  # the last id, in a partly used word
    params = [SamplingParams(temperature=0.0)] * 4
    batch = SamplingBatch.build(
        params, [[]] * 4, [[]] * 4, device="cpu", vocab_size=vocab, grammar=([1, 3], _pack(allowed))
    )
    out = apply_token_bitmask(logits, batch)
    expected = logits.clone()
    for row, mask in zip([1, 3], allowed, strict=True):
        expected[row, ~torch.from_numpy(mask)] = float("-inf")
    assert torch.equal(out, expected)
    assert not torch.isinf(logits).any()  # the input is left alone
    # The sampler takes only allowed tokens on the constrained rows.
    tokens = sample(logits, params, grammar=([1, 3], _pack(allowed))).token_ids
    assert allowed[0, tokens[1]] and allowed[1, tokens[3]]


def test_token_bitmask_narrower_than_the_logits_blocks_the_extra_ids() -> None:
    from workers.device.layers.logits_processors import apply_token_bitmask
    from workers.device.layers.sampling_batch import SamplingBatch

    logits = torch.zeros(1, 40)
    logits[0, 39] = 10.0  # an id past the tokenizer, the model's favourite
    allowed = np.zeros((1, 32), dtype=bool)
    allowed[0, 5] = True
    batch = SamplingBatch.build(
        [SamplingParams()], [[]], [[]], device="cpu", vocab_size=40, grammar=([0], _pack(allowed))
    )
    out = apply_token_bitmask(logits, batch)
    assert torch.isinf(out[0, 32:]).all() and out[0, 5] == 0.0

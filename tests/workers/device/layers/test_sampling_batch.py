"""What a SamplingBatch blocks: EOS and stop ids until min_tokens is reached (or the ids the
caller lists instead), for greedy and random rows alike."""

from __future__ import annotations

import pytest
import torch

from tests.workers.device.layers.sampling_helpers import sample
from workers.sampling_params import SamplingParams

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


# ------------------------------------------------------------------------------ top-p probe


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_top_p_rows_probe_only_on_the_cpu(device: str) -> None:
    """A top-p row without top-k may look at its best 1,024 tokens first, which asks the host
    whether they sufficed; off the CPU (a GPU: the sync would stall async scheduling) it sorts
    the whole vocabulary instead, and the batch's tensors are built without a host round trip."""
    from workers.device.layers.sampling_batch import SamplingBatch

    vocab = 5000
    params = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.5)]
    batch = SamplingBatch.build(params, [[1], [2]], [[], [3]], device=device, vocab_size=vocab)
    on_cpu = device == "cpu"
    assert batch.top_p_probe is on_cpu and (batch.candidates < vocab) is on_cpu
    assert batch.top_p.device.type == device and batch.temperature.device.type == device

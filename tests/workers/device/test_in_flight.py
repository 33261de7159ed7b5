"""The worker's side of async scheduling: placeholders for tokens sampled but not yet known
to the host, filled on the device from the previous step's samples, then overwritten by the
engine's diff; and the step output that reaches the host later."""

from __future__ import annotations

import pytest
import torch

from workers.device.in_flight import PendingOutput, SampledTokens, fill_placeholders
from workers.device.layers.sampler import SamplerOutput
from workers.device.model_runner import SeqState, prepare_inputs
from workers.device.scoring import ScoringOutputs
from workers.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def _state(sid: str, tokens: list[int], computed: int, scheduled: int) -> SeqState:
    return SeqState(sid, 3, list(tokens), GREEDY, [0, 1, 2, 3], computed, scheduled)


def test_the_engines_tokens_overwrite_placeholders_in_order() -> None:
    s = _state("a", [1, 2, 3, 9], 3, 1)
    s.add_placeholder()
    s.add_placeholder()
    assert s.token_ids == [1, 2, 3, 9, 0, 0] and s.num_placeholders == 2
    s.receive([41])
    assert s.token_ids == [1, 2, 3, 9, 41, 0] and s.num_placeholders == 1
    s.receive([42, 43])  # the second placeholder's value, then a token it had not seen
    assert s.token_ids == [1, 2, 3, 9, 41, 42, 43] and s.num_placeholders == 0


def test_placeholder_rows_read_the_previous_steps_tokens() -> None:
    # "b" decodes its unknown token; "a" decodes a known one; "c" prefills (no placeholder).
    a = _state("a", [5, 6, 7, 8], 3, 1)
    b = _state("b", [5, 6, 7], 2, 1)
    b.add_placeholder()
    b.num_computed_tokens = 3
    c = _state("c", [1, 2, 3, 4, 5], 0, 5)
    inp = prepare_inputs([a, b, c], 4, torch.device("cpu"))
    before = inp.input_ids.tolist()
    prev = SampledTokens(torch.tensor([77, 55]), {"x": 0, "b": 1})
    fill_placeholders(inp, prev)
    row_b = inp.logits_indices[[s.seq_id for s in inp.sample_states].index("b")]
    after = inp.input_ids.tolist()
    assert after[row_b] == 55 and before[row_b] == 0
    assert [t for i, t in enumerate(after) if i != row_b] == [
        t for i, t in enumerate(before) if i != row_b
    ]


def test_a_placeholder_the_previous_step_did_not_sample_is_an_error() -> None:
    b = _state("b", [5, 6, 7], 2, 1)
    b.add_placeholder()
    b.num_computed_tokens = 3
    inp = prepare_inputs([b], 4, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="b: a step computes 1 unknown tokens"):
        fill_placeholders(inp, SampledTokens(torch.tensor([1]), {"other": 0}))
    with pytest.raises(RuntimeError, match="looks one step ahead"):
        fill_placeholders(inp, None)


def test_a_pending_output_resolves_to_the_step_output() -> None:
    sampled = SamplerOutput(torch.tensor([11, 12]), None, None)
    extras = ScoringOutputs(embeddings={"e": [0.5]})
    pending = PendingOutput(["a", "b"], sampled.start_to_host(), None, extras)
    pending.lora_load_s, pending.expert_tokens = 0.25, ((1, 2),)
    out = pending.result()
    assert (out.seq_ids, out.token_ids, out.logprobs) == (["a", "b"], [11, 12], None)
    assert out.embeddings == {"e": [0.5]} and out.lora_load_s == 0.25
    assert out.expert_tokens == ((1, 2),)
    empty = PendingOutput([], None, None, ScoringOutputs()).result()
    assert (empty.seq_ids, empty.token_ids, empty.embeddings) == ([], [], None)

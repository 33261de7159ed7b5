"""merge_outputs: merged deltas add up, nothing lost; a finish or prompt logprobs reported
once survive the merge."""

from __future__ import annotations

from workers.outputs import CompletionOutput, RequestOutput, merge_outputs


def step_output(step: int, total: int, n: int = 2) -> RequestOutput:
    """Step `step` of a `total`-step stream of n samples, each adding token `step` (tN text)."""
    done = step == total - 1
    outs = [
        CompletionOutput(
            index=i,
            text="".join(f"t{k}" for k in range(step + 1)),
            token_ids=list(range(step + 1)),
            finish_reason="length" if done else None,
            delta_text=f"t{step}",
            delta_token_ids=[step],
            delta_logprobs=[{step: -1.0}],
        )
        for i in range(n)
    ]
    return RequestOutput("r", None, [1, 2], outs, finished=done)


def test_merge_concatenates_deltas_and_keeps_the_latest_state() -> None:
    merged = merge_outputs([step_output(0, 3), step_output(1, 3), step_output(2, 3)])
    assert merged.finished
    for c in merged.outputs:
        assert c.delta_text == "t0t1t2" and c.delta_token_ids == [0, 1, 2]
        assert c.delta_logprobs == [{0: -1.0}, {1: -1.0}, {2: -1.0}]
        assert c.text == "t0t1t2" and c.finish_reason == "length"


def test_merge_of_delta_outputs_keeps_a_finish_reported_once() -> None:
    # DELTA outputs: no cumulative fields; a sample's finish is reported in one output only,
    # and a later output may not list that sample at all.
    a = RequestOutput(
        "r",
        None,
        [],
        [
            CompletionOutput(0, finish_reason="stop", stop_reason=7, delta_token_ids=[7]),
            CompletionOutput(1, delta_text="x", delta_token_ids=[3]),
        ],
    )
    b = RequestOutput("r", None, [], [CompletionOutput(1, delta_text="y", delta_token_ids=[4])])
    merged = merge_outputs([a, b])
    assert [c.index for c in merged.outputs] == [0, 1]
    done, running = merged.outputs
    assert (done.finish_reason, done.stop_reason, done.delta_token_ids) == ("stop", 7, [7])
    assert (running.finish_reason, running.delta_text, running.delta_token_ids) == (
        None,
        "xy",
        [3, 4],
    )
    assert not merged.finished and merged.prompt_token_ids == []


def test_merge_keeps_prompt_logprobs_sent_with_an_earlier_output() -> None:
    first, second = step_output(0, 3), step_output(1, 3)
    first.prompt_logprobs = [None, {2: -0.5}]
    assert merge_outputs([first, second]).prompt_logprobs == [None, {2: -0.5}]
    assert merge_outputs([step_output(0, 3), step_output(1, 3)]).prompt_logprobs is None

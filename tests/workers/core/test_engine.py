"""Engine behaviour through the offline API: stops, lengths, n, seeds, bad input, output kinds."""

from __future__ import annotations

import dataclasses

import pytest

from workers import RequestOutputKind, SamplingParams


def greedy(**kw) -> SamplingParams:  # noqa: ANN003
    return SamplingParams(temperature=0.0, **kw)


def _free_run(llm, prompt: str, n: int = 40) -> tuple[list[int], str]:  # noqa: ANN001
    out = llm.generate([prompt], greedy(max_tokens=n, ignore_eos=True), use_tqdm=False)[0]
    return out.outputs[0].token_ids, out.outputs[0].text


def test_max_tokens_and_length_reason(demo_llm) -> None:
    out = demo_llm.generate(["The weather"], greedy(max_tokens=7, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 7 and out[0].outputs[0].finish_reason == "length"


def test_stop_string_spanning_tokens_is_cut(demo_llm) -> None:
    tok = demo_llm.tokenizer
    ids, text = _free_run(demo_llm, "Once upon a time")
    # Pick a stop string that starts inside one token's text and ends inside a later one.
    pieces = [tok.decode([t]) for t in ids]
    k = next(
        i for i in range(3, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 1
    )
    prefix = "".join(pieces[:k])
    stop = pieces[k][1:] + pieces[k + 1][:1]
    assert stop and text.find(stop) >= len(prefix) - 1
    cut = text.find(stop)
    out = demo_llm.generate(
        ["Once upon a time"], greedy(max_tokens=40, ignore_eos=True, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:cut]
    kept = demo_llm.generate(
        ["Once upon a time"],
        greedy(max_tokens=40, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == text[: cut + len(stop)]


def test_stop_token_ids_eos_and_ignore_eos(demo_llm) -> None:
    ids, _ = _free_run(demo_llm, "A small cat")
    target = ids[5]
    first = ids.index(target)
    out = demo_llm.generate(
        ["A small cat"], greedy(max_tokens=40, stop_token_ids=[target]), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == target
    assert out.token_ids == ids[: first + 1]  # the stop token is kept in token_ids
    # Treat the same token as EOS: stops unless ignore_eos; min_tokens postpones it.
    eng = demo_llm.engine
    saved = eng.eos_token_ids
    eng.eos_token_ids = (target,)
    try:
        stopped = demo_llm.generate(["A small cat"], greedy(max_tokens=40), use_tqdm=False)[0]
        assert stopped.outputs[0].token_ids == ids[: first + 1]
        assert stopped.outputs[0].finish_reason == "stop"
        ignored = demo_llm.generate(
            ["A small cat"], greedy(max_tokens=40, ignore_eos=True), use_tqdm=False
        )[0]
        assert ignored.outputs[0].token_ids == ids
        delayed = demo_llm.generate(
            ["A small cat"], greedy(max_tokens=40, min_tokens=first + 1), use_tqdm=False
        )[0].outputs[0]
        assert len(delayed.token_ids) > first + 1
        assert target not in delayed.token_ids[: first + 1]  # blocked before min_tokens
    finally:
        eng.eos_token_ids = saved


def test_n_samples_share_prompt_and_differ(demo_llm) -> None:
    out = demo_llm.generate(
        ["Tell me"],
        SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    toks = [tuple(c.token_ids) for c in out.outputs]
    assert all(len(t) == 12 for t in toks) and len(set(toks)) == 3
    again = demo_llm.generate(
        ["Tell me"],
        SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True),
        use_tqdm=False,
    )
    assert [tuple(c.token_ids) for c in again[0].outputs] == toks


def test_seeded_request_same_alone_and_in_batch_of_32(demo_llm) -> None:
    p = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)
    alone = demo_llm.generate(["Seeded prompt"], p, use_tqdm=False)[0].outputs[0].token_ids
    others = [f"other prompt {i}" for i in range(32)]
    other_params = [
        SamplingParams(
            max_tokens=10 + i % 7, temperature=1.0, seed=i if i % 2 else None, ignore_eos=True
        )
        for i in range(32)
    ]
    outs = demo_llm.generate(
        others[:16] + ["Seeded prompt"] + others[16:],
        other_params[:16] + [p] + other_params[16:],
        use_tqdm=False,
    )
    assert outs[16].outputs[0].token_ids == alone


def test_top_k_one_equals_greedy(demo_llm) -> None:
    g = demo_llm.generate(["Top k"], greedy(max_tokens=16, ignore_eos=True), use_tqdm=False)
    k1 = demo_llm.generate(
        ["Top k"],
        SamplingParams(max_tokens=16, temperature=1.3, top_k=1, ignore_eos=True),
        use_tqdm=False,
    )
    assert g[0].outputs[0].token_ids == k1[0].outputs[0].token_ids


def test_chat_applies_template(demo_llm) -> None:
    msgs = [{"role": "user", "content": "hello"}]
    out = demo_llm.chat(msgs, greedy(max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == demo_llm.tokenizer.apply_chat_template(msgs)


@pytest.mark.parametrize(
    ("prompt", "kwargs", "field"),
    [
        ("", {}, "prompt"),
        ([], {}, "prompt"),
        ([1, 999999], {}, "prompt token id"),
        ([1, -1], {}, "prompt token id"),
        ("x " * 3000, {}, "max_model_len"),
        ("hi", {"max_tokens": 5000}, "max_tokens"),
        ("hi", {"temperature": -0.1}, "temperature"),
        ("hi", {"top_p": 0.0}, "top_p"),
        ("hi", {"top_p": 1.5}, "top_p"),
        ("hi", {"top_k": 0}, "top_k"),
        ("hi", {"top_k": -2}, "top_k"),
        ("hi", {"min_p": 1.5}, "min_p"),
        ("hi", {"max_tokens": 0}, "max_tokens"),
        ("hi", {"n": 0}, "n"),
        ("hi", {"logprobs": 21}, "logprobs"),
        ("hi", {"stop": [1, 2]}, "stop"),
    ],
)
def test_bad_input_raises_value_error_naming_field(demo_llm, prompt, kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        demo_llm.generate([prompt], SamplingParams(**{"max_tokens": 4, **kwargs}), use_tqdm=False)
    assert demo_llm.stats().kv_blocks_used == 0


def test_bad_request_does_not_disturb_others(demo_llm) -> None:
    eng = demo_llm.engine
    good = greedy(max_tokens=6, ignore_eos=True)
    expected = demo_llm.generate(["good one", "good two"], good, use_tqdm=False)
    eng.add_prompt("g1", "good one", good)
    with pytest.raises(ValueError, match="prompt token id"):
        eng.add_prompt("bad", [5, 10**9], good)
    eng.add_prompt("g2", "good two", good)
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            done[out.request_id] = out.outputs[0].token_ids
    assert done == {"g1": expected[0].outputs[0].token_ids, "g2": expected[1].outputs[0].token_ids}


def test_output_kinds_build_only_what_they_ask_for(demo_llm) -> None:
    eng = demo_llm.engine
    delta = greedy(max_tokens=6, ignore_eos=True, logprobs=1)
    final = dataclasses.replace(delta, output_kind=RequestOutputKind.FINAL_ONLY)
    eng.add_prompt("delta", "output kinds", delta)
    eng.add_prompt("final", "output kinds", final)
    seen: dict[str, list] = {"delta": [], "final": []}
    while eng.has_unfinished():
        for out in eng.step():
            seen[out.request_id].append(out)
    assert [o.finished for o in seen["final"]] == [True]
    assert [o.finished for o in seen["delta"]] == [False] * 5 + [True]
    for o in seen["delta"][:-1]:  # running: one new token each, nothing cumulative
        c = o.outputs[0]
        assert len(c.delta_token_ids) == 1 and len(c.delta_logprobs) == 1
        assert (o.prompt, o.prompt_token_ids, c.text, c.token_ids, c.logprobs) == (
            None,
            [],
            "",
            [],
            None,
        )
    d, f = seen["delta"][-1], seen["final"][0]
    assert d.prompt == f.prompt == "output kinds" and d.prompt_token_ids == f.prompt_token_ids
    assert d.metrics is not None and f.metrics is not None
    dc, fc = d.outputs[0], f.outputs[0]
    assert (dc.text, dc.token_ids, dc.logprobs) == (fc.text, fc.token_ids, fc.logprobs)
    assert len(fc.token_ids) == 6 and len(dc.delta_token_ids) == 1  # the last delta only
    assert fc.delta_token_ids == fc.token_ids and fc.delta_text == fc.text  # all in one delta
    streamed = [t for o in seen["delta"] for t in o.outputs[0].delta_token_ids]
    assert streamed == dc.token_ids


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_abort_returns_everything_not_yet_handed_out(demo_llm, kind) -> None:  # noqa: ANN001
    eng = demo_llm.engine
    params = dataclasses.replace(greedy(max_tokens=20, ignore_eos=True), output_kind=kind)
    eng.add_prompt("ab", "abort me", params)
    handed = [t for _ in range(3) for o in eng.step() for t in o.outputs[0].delta_token_ids]
    out = eng.abort("ab")
    assert out is not None and out.finished and out.metrics is not None
    c = out.outputs[0]
    assert c.finish_reason == "abort" and len(c.token_ids) == 3
    assert handed + c.delta_token_ids == c.token_ids
    assert len(handed) == (3 if kind is RequestOutputKind.DELTA else 0)
    assert not eng.has_unfinished() and demo_llm.stats().kv_blocks_used == 0


def test_offline_generate_leaves_the_callers_params_alone(demo_llm) -> None:
    params = greedy(max_tokens=3)
    outs = demo_llm.generate(["a", "b"], params, use_tqdm=False)
    assert params.output_kind is RequestOutputKind.DELTA
    assert all(o.finished and len(o.outputs[0].token_ids) == 3 for o in outs)

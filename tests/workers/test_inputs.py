"""InputChecker: the one place a request is validated. Errors name their field first (how
cluster.errors turns them into an OpenAI `param`); a checked request is an EngineInput."""

from __future__ import annotations

import dataclasses

import pytest

from workers import EngineInput, InputChecker, SamplingParams
from workers.inputs import ResumedSample
from workers.lora.request import LoRARequest

CHECKER = InputChecker(vocab_size=100, max_model_len=32)
PARAMS = SamplingParams(max_tokens=8)


def test_a_good_request_becomes_an_engine_input() -> None:
    inp = CHECKER.check([1, 2, 99], PARAMS, prompt="text")
    assert inp == EngineInput((1, 2, 99), PARAMS, "text")
    assert isinstance(inp.prompt_token_ids, tuple)
    with pytest.raises(dataclasses.FrozenInstanceError):
        inp.prompt = "changed"  # type: ignore[misc]
    # The limits are inclusive where they should be: 24 + 8 == max_model_len fits.
    assert len(CHECKER.check([5] * 24, PARAMS).prompt_token_ids) == 24
    assert CHECKER.check([5] * 31, SamplingParams(max_tokens=None)).params.max_tokens is None


@pytest.mark.parametrize(
    ("ids", "params", "message"),
    [
        ([], PARAMS, r"^prompt must not be empty"),
        ((), PARAMS, r"^prompt must not be empty"),
        ("abc", PARAMS, r"^prompt must be a list of token ids"),
        (None, PARAMS, r"^prompt must be a list of token ids"),
        ([1, 100], PARAMS, r"^prompt token id 100 is outside the vocabulary \[0, 100\)"),
        ([1, -1], PARAMS, r"^prompt token id -1 is outside"),
        ([1, True], PARAMS, r"^prompt token id True is outside"),
        ([1, 2.0], PARAMS, r"^prompt token id 2.0 is outside"),
        ([5] * 32, SamplingParams(max_tokens=None), r"^prompt is 32 tokens, which leaves no room"),
        (
            [5] * 25,
            PARAMS,
            r"^max_tokens \(8\) \+ prompt length \(25\) exceeds max_model_len \(32\)",
        ),
        ([1], {"max_tokens": 8}, r"^params must be a SamplingParams"),
    ],
)
def test_bad_input_names_its_field_first(ids, params, message) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=message):
        CHECKER.check(ids, params)


def test_params_are_validated_again() -> None:
    # A SamplingParams changed after construction is caught (the checker calls validate()).
    params = SamplingParams()
    params.top_p = 0.0
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\]"):
        CHECKER.check([1], params)


def test_check_returns_the_final_input_with_its_adapter_and_tenant() -> None:
    lora = LoRARequest("a", 7, "/x/a")
    inp = CHECKER.check([1, 2], PARAMS, priority=-2, lora=lora, tenant="acme")
    assert inp == EngineInput((1, 2), PARAMS, priority=-2, tenant="acme", lora=lora)
    assert CHECKER.check([1], PARAMS) == EngineInput((1,), PARAMS)  # the base model, no tenant
    with pytest.raises(ValueError, match=r"^lora must be a LoRARequest, got dict"):
        CHECKER.check([1], PARAMS, lora={"lora_name": "a"})  # type: ignore[arg-type]


def test_a_request_validates_its_params_once_whatever_its_prompts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    params = SamplingParams(max_tokens=4)  # built (and validated) before counting starts
    calls = []
    validate = SamplingParams.validate

    def counted(self: SamplingParams) -> None:
        calls.append(self)
        validate(self)

    monkeypatch.setattr(SamplingParams, "validate", counted)
    request = CHECKER.request(params, -1, lora=LoRARequest("a", 7, "/x/a"), tenant="acme")
    inputs = [request.input([t, t + 1]) for t in range(5)]
    assert calls == [params]
    assert {(i.priority, i.tenant, i.lora.lora_int_id) for i in inputs} == {(-1, "acme", 7)}
    assert [i.prompt_token_ids for i in inputs] == [(t, t + 1) for t in range(5)]
    # Each prompt is still checked against the model, naming the field given.
    with pytest.raises(ValueError, match=r"^prompt\[2\] token id 100 is outside"):
        request.input([100], field="prompt[2]")
    assert calls == [params]


def test_the_field_name_is_the_callers() -> None:
    with pytest.raises(ValueError, match=r"^input token id 555 is outside"):
        CHECKER.check([555], PARAMS, field="input")
    with pytest.raises(ValueError, match=r"^max_tokens \(8\) \+ input length \(30\)"):
        CHECKER.check([1] * 30, PARAMS, field="input")


def test_check_prompt_encodes_text_and_keeps_it(demo_dir) -> None:  # noqa: ANN001
    from workers.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(demo_dir)
    checker = InputChecker(vocab_size=tok.vocab_size, max_model_len=64)
    inp = checker.check_prompt("hello world", PARAMS, tok)
    assert inp.prompt == "hello world"
    assert list(inp.prompt_token_ids) == tok.encode("hello world")
    ids = checker.check_prompt([3, 4], PARAMS, tok)
    assert ids == EngineInput((3, 4), PARAMS, None)
    with pytest.raises(ValueError, match="^prompt must not be empty"):
        checker.check_prompt("", PARAMS, tok)
    with pytest.raises(ValueError, match="^prompt must be a non-empty string or"):
        checker.check_prompt([], PARAMS, tok)
    with pytest.raises(ValueError, match=r"^prompt is \d+ tokens"):
        checker.check_prompt(" ".join(["word"] * 200), SamplingParams(max_tokens=None), tok)


def _resumed(index: int = 0, out: tuple[int, ...] = (4, 5), **kw) -> ResumedSample:  # noqa: ANN003
    return ResumedSample(index, out, **{"text_sent": 3, **kw})


def test_check_resume_sets_the_samples_in_index_order() -> None:
    inp = CHECKER.check([1, 2], dataclasses.replace(PARAMS, n=3))
    assert inp.resume == ()
    samples = [_resumed(2), _resumed(0, ())]
    resumed = CHECKER.check_resume(inp, samples)
    assert resumed.resume == (samples[1], samples[0])
    assert (resumed.prompt_token_ids, resumed.params) == (inp.prompt_token_ids, inp.params)
    # Resuming an already resumed input replaces its samples.
    assert CHECKER.check_resume(resumed, [samples[0]]).resume == (samples[0],)
    # The limits are inclusive where they should be: 2 + 7 outputs < max_tokens 8 fits.
    assert CHECKER.check_resume(inp, [_resumed(out=(1,) * 7)]).resume[0].output_token_ids
    lp = CHECKER.check([1], dataclasses.replace(PARAMS, logprobs=1))
    entries = ({4: -0.1}, {5: -0.2})
    assert CHECKER.check_resume(lp, [_resumed(logprobs=entries)]).resume[0].logprobs == entries


@pytest.mark.parametrize(
    ("samples", "params", "message"),
    [
        ([], PARAMS, r"^resume must list at least one unfinished sample"),
        (None, PARAMS, r"^resume must list"),
        ([(0, (1,), 0)], PARAMS, r"^resume samples must be ResumedSample, got tuple"),
        ([_resumed(1)], PARAMS, r"^resume sample index 1 is outside \[0, n=1\)"),
        ([_resumed(-1)], PARAMS, r"^resume sample index -1 is outside"),
        ([_resumed(True)], PARAMS, r"^resume sample index True is outside"),
        ([_resumed(0), _resumed(0)], PARAMS, r"^resume sample index 0 is listed twice"),
        ([_resumed(out=[4])], PARAMS, r"^resume sample 0 output_token_ids must be a tuple"),
        ([_resumed(out=(4, 100))], PARAMS, r"^resume sample 0 token id 100 is outside"),
        ([_resumed(out=(4, -1))], PARAMS, r"^resume sample 0 token id -1 is outside"),
        ([_resumed(out=(1,) * 8)], PARAMS, r"^resume sample 0 has 8 outputs: max_tokens \(8\)"),
        (
            [_resumed(out=(1,) * 30)],
            SamplingParams(max_tokens=None),
            r"^resume sample 0: prompt \+ outputs \(32 tokens\) leave no room to generate "
            r"within max_model_len \(32\)",
        ),
        ([_resumed(text_sent=-1)], PARAMS, r"^resume sample 0 text_sent must be an int >= 0"),
        ([_resumed(logprobs=({},))], PARAMS, r"^resume sample 0 has logprobs the request did"),
        (
            [_resumed()],
            SamplingParams(max_tokens=8, logprobs=0),
            r"^resume sample 0 needs one logprobs entry per output token \(2\)",
        ),
        (
            [_resumed(logprobs=({},))],
            SamplingParams(max_tokens=8, logprobs=0),
            r"^resume sample 0 needs one logprobs entry",
        ),
    ],
)
def test_bad_resume_names_its_field_first(samples, params, message) -> None:  # noqa: ANN001
    inp = CHECKER.check([1, 2], params)
    with pytest.raises(ValueError, match=message):
        CHECKER.check_resume(inp, samples)

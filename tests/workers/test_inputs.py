"""InputChecker: the one place a request is validated. Errors name their field first (how
cluster.errors turns them into an OpenAI `param`); a checked request is an EngineInput."""

from __future__ import annotations

import dataclasses

import pytest

from workers import EngineInput, InputChecker, SamplingParams

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

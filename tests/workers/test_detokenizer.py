"""Incremental detokenization and stop strings, on the demo checkpoint's byte-level tokenizer."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workers.demo import demo_model_dir
from workers.detokenizer import (
    IncrementalDetokenizer,
    OutputText,
    StopMatch,
    find_stop,
    stop_holdback,
)
from workers.tokenizer import Tokenizer

MIXED = "안녕하세요 세계 🌍🚀 kvray 👩‍👩‍👧 and 🦀𝔘 done"
FFFD = "\ufffd"
HYPOTHESIS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_pretrained(demo_model_dir())


def _stream(det: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    deltas = [det.step(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas + [det.flush()]


def test_multibyte_text_token_by_token(tok: Tokenizer) -> None:
    ids = tok.encode(MIXED)
    # The test only means something if some tokens end inside a character.
    assert any(FFFD in tok.decode([i]) for i in ids)
    det = IncrementalDetokenizer(tok, tok.encode("Say hi:"), skip_special_tokens=True)
    deltas = _stream(det, ids)
    assert not any(FFFD in d for d in deltas)
    assert "" in deltas[:-1]  # something was held back
    assert "".join(deltas) == det.text == tok.decode(ids) == MIXED


@pytest.mark.parametrize("chunk", [2, 3, 100])
def test_chunked_steps_give_the_same_text(tok: Tokenizer, chunk: int) -> None:
    ids = tok.encode(MIXED)
    det = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    deltas = _stream(det, ids, chunk)
    assert not any(FFFD in d for d in deltas)
    assert "".join(deltas) == MIXED


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_are_skipped_or_kept(tok: Tokenizer, skip: bool) -> None:
    im_end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("hi 🌍") + [im_end] + tok.encode(" 🦀 bye")
    prompt = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    text = "".join(_stream(det, ids))
    assert text == tok.decode(ids, skip_special_tokens=skip)
    assert text == ("hi 🌍 🦀 bye" if skip else "hi 🌍<|im_end|> 🦀 bye")


def test_flush_releases_an_unfinished_character(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🦀")
    cut = next(n for n in range(len(ids), 0, -1) if tok.decode(ids[:n]).endswith(FFFD))
    det = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    streamed = "".join(det.step([i]) for i in ids[:cut])
    assert FFFD not in streamed
    assert streamed + det.flush() == tok.decode(ids[:cut])


def test_prompt_ending_inside_a_character(tok: Tokenizer) -> None:
    ids = tok.encode("🦀🦀 crab")
    split = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith(FFFD))
    det = IncrementalDetokenizer(tok, ids[:split], skip_special_tokens=True)
    assert "".join(_stream(det, ids[split:])) == tok.decode(ids[split:])


@HYPOTHESIS
@given(data=st.data())
def test_random_token_streams_match_one_shot_decode(tok: Tokenizer, data: st.DataObject) -> None:
    # Random ids include lone byte tokens, so invalid UTF-8 and specials are both covered.
    token = st.integers(min_value=0, max_value=tok.vocab_size - 1)
    prompt = data.draw(st.lists(token, max_size=8))
    ids = data.draw(st.lists(token, max_size=40))
    chunk = data.draw(st.integers(min_value=1, max_value=4))
    skip = data.draw(st.booleans())
    det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = _stream(det, ids, chunk)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    assert not any(d.endswith(FFFD) for d in deltas[:-1])


def test_find_stop_spanning_the_boundary() -> None:
    text = "the answer is 42, END of story"
    start = text.index("END") + 1  # last check saw "...E"; "ND of..." is new
    assert find_stop(text, ["END"], start) == StopMatch("END", text.index("END"))
    assert find_stop(text, ["END"], start, include_stop_str_in_output=True) == StopMatch(
        "END", text.index("END") + 3
    )
    # An occurrence that ended before `start` was already ruled out and is not reported again.
    assert find_stop(text, ["the"], start) is None
    assert find_stop(text, ["", "nope"], 0) is None


def test_find_stop_prefers_the_first_to_complete() -> None:
    text = "abcd"
    assert find_stop(text, ["abcd", "c"], 0) == StopMatch("c", 2)
    # Same end: the longer (earlier starting) occurrence wins, whatever the list order.
    assert find_stop(text, ["cd", "bcd"], 0) == StopMatch("bcd", 1)
    assert find_stop(text, ["bcd", "cd"], 0) == StopMatch("bcd", 1)


def test_stop_holdback() -> None:
    assert stop_holdback("hello wor", ["world"]) == 3
    assert stop_holdback("hello world", ["world"]) == 0  # a full match is not a prefix
    assert stop_holdback("hello", ["xyz", "lo!"]) == 2
    assert stop_holdback("hello", []) == 0
    assert stop_holdback("aaa", ["aaab"]) == 3


@pytest.mark.parametrize("include", [False, True])
def test_output_text_cuts_at_a_stop_spanning_tokens(tok: Tokenizer, include: bool) -> None:
    text = "Weather today: rain then 🌧️ storms, then sun."
    stop = "n 🌧️ st"
    ids = tok.encode(text)
    out = OutputText(tok, [], True, ["never", stop], include_stop_str_in_output=include)
    streamed, matched = [], None
    for i in ids:
        matched = out.step([i])
        streamed.append(out.pop_delta(finished=matched is not None))
        if matched is not None:
            break
    assert matched == stop
    expected = text[: text.index(stop) + (len(stop) if include else 0)]
    assert out.text == expected and "".join(streamed) == expected
    assert FFFD not in out.text


def test_output_text_without_stops_streams_everything(tok: Tokenizer) -> None:
    ids = tok.encode(MIXED)
    out = OutputText(tok, [], True)
    parts = []
    for i in ids:
        assert out.step([i]) is None
        parts.append(out.pop_delta(finished=False))
    out.flush()
    parts.append(out.pop_delta(finished=True))
    assert "".join(parts) == MIXED


def test_output_text_min_tokens_disables_the_check(tok: Tokenizer) -> None:
    out = OutputText(tok, [], True, ["hello"])
    assert out.step(tok.encode("hello"), check_stop=False) is None
    assert out.step(tok.encode(" world")) is None
    assert out.text == "hello world"
    assert out.step(tok.encode(" hello")) == "hello"
    assert out.text == "hello world "


WORDS = ["ab", "ba", "a", "b", "c", " ", "🌍", "안녕", "ca", "abc"]


@HYPOTHESIS
@given(data=st.data())
def test_streaming_never_shows_text_that_is_later_cut(tok: Tokenizer, data: st.DataObject) -> None:
    text = "".join(data.draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=20)))
    # Slices of the text itself, so stops do occur and often straddle token boundaries.
    piece = st.tuples(st.integers(0, len(text) - 1), st.integers(1, 5)).map(
        lambda ij: text[ij[0] : ij[0] + ij[1]]
    )
    stops = data.draw(
        st.lists(piece | st.text(alphabet="abc 🌍안", min_size=1, max_size=4), max_size=3)
    )
    include = data.draw(st.booleans())
    ids = tok.encode(text)
    chunk = data.draw(st.integers(min_value=1, max_value=3))

    out = OutputText(tok, [], True, stops, include_stop_str_in_output=include)
    shown = ""
    for i in range(0, len(ids), chunk):
        matched = out.step(ids[i : i + chunk])
        shown += out.pop_delta(finished=matched is not None)
        assert out.text.startswith(shown)
        if matched is not None:
            break
    else:
        out.flush()
        shown += out.pop_delta(finished=True)

    # The reference answer, from the whole text at once: the occurrence that ends first.
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if hits:
        end, begin, stop = min(hits)
        assert out.stop == stop
        assert out.text == text[: end if include else begin]
    else:
        assert out.stop is None and out.text == text
    assert shown == out.text

"""The llguidance backend on the demo tokenizer: masks, matcher steps, EOS only where the
grammar accepts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from workers.structured import StructuredOutputs
from workers.structured.backend import (
    CompiledGrammar,
    bitmask_words,
    build_tokenizer,
    grammar_text,
)
from workers.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(demo_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(demo_dir)


@pytest.fixture(scope="module")
def lltok(tok: Tokenizer):  # noqa: ANN201
    return build_tokenizer(tok.hf, tok.vocab_size, tok.eos_token_ids)


def _allowed(matcher, vocab: int) -> set[int]:  # noqa: ANN001
    bits = np.zeros((1, bitmask_words(vocab)), dtype=np.int32)
    matcher.fill_bitmask(bits, 0)
    flat = np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab]
    return set(np.flatnonzero(flat).tolist())


def test_choice_mask_allows_only_prefixes_and_eos_only_at_the_end(tok, lltok) -> None:  # noqa: ANN001
    spec = StructuredOutputs(choice=("yes", "no"))
    m = CompiledGrammar(lltok, grammar_text(spec)).matcher()
    first = _allowed(m, tok.vocab_size)
    assert first
    assert not first & set(tok.eos_token_ids)  # nothing generated yet: EOS not allowed
    for t in first:
        text = tok.decode([t], skip_special_tokens=False)
        assert "yes".startswith(text) or "no".startswith(text), text
    # Walk "no" token by token, taking the longest allowed token each time.
    out = ""
    while not m.is_terminated:
        allowed = _allowed(m, tok.vocab_size)
        if set(tok.eos_token_ids) & allowed:
            assert out in ("yes", "no")
            break
        t = max(
            (t for t in allowed if "no".startswith(out + tok.decode([t]))),
            key=lambda t: len(tok.decode([t])),
        )
        assert m.accept(t)
        out += tok.decode([t])
    assert out == "no"


def test_a_token_outside_the_grammar_is_refused(tok, lltok) -> None:  # noqa: ANN001
    m = CompiledGrammar(lltok, grammar_text(StructuredOutputs(regex="[0-9]+"))).matcher()
    letter = tok.encode("x", add_special_tokens=False)[0]
    assert letter not in _allowed(m, tok.vocab_size)
    assert not m.accept(letter)
    assert m.error


def test_regex_accepts_then_allows_eos(tok, lltok) -> None:  # noqa: ANN001
    m = CompiledGrammar(lltok, grammar_text(StructuredOutputs(regex="ab?"))).matcher()
    a = next(t for t in _allowed(m, tok.vocab_size) if tok.decode([t]) == "a")
    assert m.accept(a)
    after = _allowed(m, tok.vocab_size)
    assert set(tok.eos_token_ids) <= after  # "a" is a full match: EOS is allowed
    assert m.num_consumed == 1
    m.rollback(1)
    assert m.num_consumed == 0
    assert not set(tok.eos_token_ids) & _allowed(m, tok.vocab_size)


def test_ids_past_the_tokenizer_are_never_allowed(tok) -> None:  # noqa: ANN001
    wider = tok.vocab_size + 40  # a model whose embedding is padded past the tokenizer
    lt = build_tokenizer(tok.hf, wider, tok.eos_token_ids)
    m = CompiledGrammar(lt, grammar_text(StructuredOutputs.from_schema(True))).matcher()
    allowed = _allowed(m, wider)
    assert allowed and max(allowed) < tok.vocab_size


def test_compile_error_raises(lltok) -> None:  # noqa: ANN001
    spec = StructuredOutputs(grammar="start: nowhere")
    with pytest.raises(ValueError, match="nowhere"):
        CompiledGrammar(lltok, grammar_text(spec))

"""Forced tool calls held to the model's own format (cluster/ingress/tool_formats/grammars.py):
the grammar lets the engine write exactly the calls the format's reader reads back, and
nothing else (not the JSON array of the formats without a grammar)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from cluster.ingress import tools
from cluster.ingress.tool_formats.grammars import has_call_grammar
from workers.structured.backend import (
    CompiledGrammar,
    bitmask_words,
    build_tokenizer,
    grammar_text,
)
from workers.tokenizer import Tokenizer

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "time"}},
]
HERMES_TWO = (
    '<tool_call>\n{"name":"weather","arguments":{"city":"Oslo"}}\n</tool_call>\n'
    '<tool_call>\n{"name":"time","arguments":{}}\n</tool_call>'
)
LLAMA_TWO = '{"name":"weather","parameters":{"city":"Oslo"}}; {"name":"time","parameters":{}}'
ARRAY = '[{"name":"weather","arguments":{"city":"Oslo"}}]'


@pytest.fixture(scope="module")
def tok(demo_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(demo_dir)


@pytest.fixture(scope="module")
def lltok(tok: Tokenizer):  # noqa: ANN201
    return build_tokenizer(tok.hf, tok.vocab_size, tok.eos_token_ids)


def _use(fmt: str | None, choice: object = "required", parallel: bool | None = None):  # noqa: ANN202
    use = tools.tool_use(TOOLS, choice, parallel)
    assert use is not None
    return use if fmt is None else replace(use, format=fmt)


def _writes(use: tools.ToolUse, text: str, tok: Tokenizer, lltok) -> bool:  # noqa: ANN001
    """Whether the use's constraint lets the engine write exactly `text`, then stop (walking
    it token by token, the longest allowed token each time)."""
    constraint = use.constraint()
    assert constraint is not None
    m = CompiledGrammar(lltok, grammar_text(constraint.spec)).matcher()
    out = ""
    while out != text:
        bits = np.zeros((1, bitmask_words(tok.vocab_size)), dtype=np.int32)
        m.fill_bitmask(bits, 0)
        allowed = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little"))
        fits = [
            t
            for t in allowed.tolist()
            if t < tok.vocab_size and text.startswith(out + tok.decode([t])) and tok.decode([t])
        ]
        if not fits:
            return False
        t = max(fits, key=lambda t: len(tok.decode([t])))
        assert m.accept(t)
        out += tok.decode([t])
    bits = np.zeros((1, bitmask_words(tok.vocab_size)), dtype=np.int32)
    m.fill_bitmask(bits, 0)
    allowed = set(np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little")))
    return bool(set(tok.eos_token_ids) & allowed)


def _read(use: tools.ToolUse, text: str) -> list[tuple[str, dict]]:
    parser = use.parser()
    events = parser.feed(text) + parser.finish()
    return [(e.name, json.loads(e.arguments)) for e in events if not isinstance(e, str)]


CALLS = [("weather", {"city": "Oslo"}), ("time", {})]


@pytest.mark.parametrize(("fmt", "text"), [("hermes", HERMES_TWO), ("llama3_json", LLAMA_TWO)])
def test_forced_calls_are_written_and_read_in_the_format(fmt: str, text: str, tok, lltok) -> None:  # noqa: ANN001
    use = _use(fmt)
    assert has_call_grammar(fmt)
    assert _writes(use, text, tok, lltok)
    assert not _writes(use, ARRAY, tok, lltok)  # not the array
    assert _read(use, text) == CALLS


def test_one_call_when_named_or_not_parallel(tok, lltok) -> None:  # noqa: ANN001
    one = HERMES_TWO.split('\n<tool_call>\n{"name":"time"')[0]
    for use in (
        _use("hermes", parallel=False),
        _use("hermes", {"type": "function", "function": {"name": "weather"}}),
    ):
        assert _writes(use, one, tok, lltok)
        assert not _writes(use, HERMES_TWO, tok, lltok)
    named_time = _use("hermes", {"type": "function", "function": {"name": "time"}})
    assert not _writes(named_time, one, tok, lltok)


@pytest.mark.parametrize("fmt", [None, "mistral", "qwen3_coder", "pythonic"])
def test_the_other_formats_force_the_array(fmt: str | None, tok, lltok) -> None:  # noqa: ANN001
    use = _use(fmt)
    assert _writes(use, ARRAY, tok, lltok)
    assert _read(use, ARRAY) == CALLS[:1]

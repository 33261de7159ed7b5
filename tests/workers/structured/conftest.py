"""Fixtures of the structured-decoding tests that drive StructuredDecoding by hand: the demo
tokenizer, a grammar compiler over it, and a fresh StructuredDecoding per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from workers.structured.compiler import GrammarCompiler
from workers.structured.decoding import StructuredDecoding
from workers.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(demo_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(demo_dir)


@pytest.fixture(scope="module")
def compiler(tok: Tokenizer) -> Iterator[GrammarCompiler]:
    c = GrammarCompiler(tok.hf, tok.vocab_size, tok.eos_token_ids, cache_size=8)
    yield c
    c.shutdown()


@pytest.fixture
def dec(compiler: GrammarCompiler, tok: Tokenizer) -> StructuredDecoding:
    return StructuredDecoding(compiler, tok.vocab_size, timeout_s=60.0)

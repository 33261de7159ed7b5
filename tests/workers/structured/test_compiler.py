"""GrammarCompiler: background compiles, a bounded LRU keyed by the spec, failures not kept."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from workers.structured import StructuredOutputs
from workers.structured.backend import bitmask_words
from workers.structured.compiler import GrammarCompiler
from workers.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def compiler(demo_dir: Path):  # noqa: ANN201
    tok = Tokenizer.from_pretrained(demo_dir)
    c = GrammarCompiler(tok.hf, tok.vocab_size, tok.eos_token_ids, cache_size=2)
    yield c
    c.shutdown()


def test_same_spec_is_compiled_once_and_the_cache_is_bounded(compiler) -> None:  # noqa: ANN001
    a = StructuredOutputs.from_schema({"type": "object", "properties": {"x": {"type": "integer"}}})
    s0 = compiler.stats()
    first = compiler.get(a)
    again = compiler.get(
        StructuredOutputs.from_schema({"type": "object", "properties": {"x": {"type": "integer"}}})
    )  # an equal spec, built anew
    assert again is first
    first.result()
    s1 = compiler.stats()
    assert (s1.cache_misses - s0.cache_misses, s1.cache_hits - s0.cache_hits) == (1, 1)
    assert s1.compiles - s0.compiles == 1 and s1.compile_seconds > s0.compile_seconds
    assert len(s1.recent_compile_seconds) >= 1
    # Two more specs push `a` out of a cache of two: it compiles again.
    compiler.get(StructuredOutputs(regex="b+")).result()
    compiler.get(StructuredOutputs(choice=("c", "d"))).result()
    assert compiler.get(a) is not first
    assert compiler.stats().cache_misses - s0.cache_misses == 4


def test_a_failed_compile_raises_from_its_future_and_is_not_kept(compiler) -> None:  # noqa: ANN001
    bad = StructuredOutputs(grammar="start: nowhere")
    fut = compiler.get(bad)
    with pytest.raises(ValueError, match="nowhere"):
        fut.result()
    assert compiler.get(bad) is not fut  # retried, not served from the cache


def test_each_sequence_gets_its_own_matcher(compiler, demo_dir: Path) -> None:  # noqa: ANN001
    tok = Tokenizer.from_pretrained(demo_dir)
    compiled = compiler.get(StructuredOutputs(regex="xy")).result()
    m1, m2 = compiled.matcher(), compiled.matcher()
    [x] = tok.encode("x", add_special_tokens=False)
    assert m1.accept(x)  # m1 advancing leaves m2 at the start
    words = bitmask_words(tok.vocab_size)
    b1, b2 = np.zeros((1, words), np.int32), np.zeros((1, words), np.int32)
    m1.fill_bitmask(b1, 0)
    m2.fill_bitmask(b2, 0)
    bit = np.int32(1 << (x % 32))
    assert b2[0, x // 32] & bit and not b1[0, x // 32] & bit
    assert (m1.num_consumed, m2.num_consumed) == (1, 0)

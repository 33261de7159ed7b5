"""The one place that talks to the grammar library (llguidance): spec -> grammar text, grammar
checks, a compiled grammar, and a per-sequence matcher. Everything else in the engine sees only
`CompiledGrammar` and `Matcher`, so another backend (xgrammar) would replace this module only.

llguidance compiles a grammar lazily and cheaply (a parser per matcher, no per-vocabulary
tables), computes a token mask in tens of microseconds, and has no GPU or triton dependency.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from workers.structured.spec import StructuredOutputs

# JSON is generated compact (no optional whitespace): a weak model cannot then spend its whole
# token budget on spaces and newlines between values, and equal outputs are byte-equal.
_JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ",",
    "key_separator": ":",
}


def grammar_text(spec: StructuredOutputs) -> str:
    """The llguidance grammar for `spec`; raises ValueError naming the field when the spec's
    text cannot even be turned into a grammar (not JSON, a grammar that does not parse)."""
    from llguidance import LLMatcher

    kind = spec.kind
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=_JSON_OPTIONS)
    if kind == "json":
        assert spec.json is not None
        try:
            schema = json.loads(spec.json)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise ValueError(
                "structured_outputs.json must be a JSON schema object (or true), "
                f"got {type(schema).__name__}"
            )
        try:
            return LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs.json: {e}") from None
    if kind == "regex":
        assert spec.regex is not None
        return LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        assert spec.choice is not None
        # A Lark alternation of literal strings: JSON string escapes are Lark's too.
        lark = "start: " + " | ".join(json.dumps(c) for c in spec.choice)
        return LLMatcher.grammar_from_lark(lark)
    assert spec.grammar is not None
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        lark = any_to_lark(spec.grammar)  # GBNF (llama.cpp's EBNF) becomes Lark; Lark stays
    except Exception as e:  # noqa: BLE001 - the converter raises plain exceptions on bad input
        raise ValueError(f"structured_outputs.grammar: cannot convert from EBNF: {e}") from None
    return LLMatcher.grammar_from_lark(lark)


def grammar_error(grammar: str, tokenizer: Any = None) -> str | None:
    """Why llguidance refuses `grammar` (unsupported schema keys, bad regex, ...), or None."""
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        return "; ".join(m.strip() for m in messages) or "invalid"
    return None


def build_tokenizer(hf_tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> Any:
    """The llguidance view of the checkpoint's tokenizer (about a second: build it once).

    `vocab_size` is the model's (logits) width, which may exceed the tokenizer's: the extra
    ids have no text, so no grammar ever allows them.
    """
    import llguidance.hf

    return llguidance.hf.from_tokenizer(
        hf_tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None
    )


class CompiledGrammar:
    """A grammar compiled for one tokenizer: a matcher in its start state, copied per sequence."""

    def __init__(self, tokenizer: Any, grammar: str) -> None:
        from llguidance import LLMatcher

        self._template = LLMatcher(tokenizer, grammar, log_level=0)
        if self._template.is_error():
            raise ValueError(self._template.get_error() or "grammar does not compile")

    def matcher(self) -> Matcher:
        return Matcher(self._template.deep_copy())


class Matcher:
    """One sequence's position in its grammar: fills its row of the token bitmask, advances with
    each sampled token."""

    def __init__(self, matcher: Any) -> None:
        self._m = matcher
        self.num_consumed = 0

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Writes the allowed tokens (bit t % 32 of word t // 32) into `bitmask[row]` (int32)."""
        view = bitmask[row]
        self._m.unsafe_compute_mask_ptr(view.ctypes.data, view.nbytes)

    def accept(self, token: int) -> bool:
        """Advances past `token`; False when the grammar does not allow it."""
        ok = bool(self._m.consume_token(token))
        if ok:
            self.num_consumed += 1
        return ok

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)
            self.num_consumed -= num_tokens

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing more (EOS only)."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str | None:
        return self._m.get_error() or None if self._m.is_error() else None


class MaskFiller:
    """Fills many matchers' bitmask rows in one call, on llguidance's own thread pool."""

    def __init__(self) -> None:
        self._executor: Any = None  # made on first use: engines without grammars need none

    def fill(self, matchers: list[Matcher], bitmask: np.ndarray) -> None:
        """Row i of `bitmask` ([len(matchers), words] int32, C-contiguous) for matchers[i]."""
        if len(matchers) == 1:
            matchers[0].fill_bitmask(bitmask, 0)
            return
        if self._executor is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor()
        assert bitmask.flags.c_contiguous and bitmask.dtype == np.int32
        self._executor.unsafe_compute_mask_ptr(
            [(m._m, i) for i, m in enumerate(matchers)],
            bitmask.ctypes.data,
            bitmask.shape[1] * 4,
            len(matchers),
        )


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return (vocab_size + 31) // 32

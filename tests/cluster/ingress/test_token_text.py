"""Token text for logprobs: each id decoded alone, special tokens kept, and cached."""

from __future__ import annotations

from cluster.ingress.token_text import TokenStrings


def test_each_id_is_decoded_once() -> None:
    calls: list[list[int]] = []

    def decode(ids: list[int]) -> str:
        calls.append(ids)
        return f"<{ids[0]}>"

    tok = TokenStrings(decode)
    assert [tok(5), tok(6), tok(5)] == ["<5>", "<6>", "<5>"]
    assert calls == [[5], [6]]


def test_of_a_tokenizer_keeps_special_tokens() -> None:
    from workers.demo import ENDOFTEXT, demo_model_dir
    from workers.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(demo_model_dir())
    (eot,) = tokenizer.encode(ENDOFTEXT, add_special_tokens=False)
    tok = TokenStrings.of(tokenizer)
    assert tok(eot) == ENDOFTEXT
    ids = tokenizer.encode("Once upon a time")
    assert "".join(tok(t) for t in ids) == tokenizer.decode(ids)

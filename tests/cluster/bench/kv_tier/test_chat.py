"""The chat part of `kvray bench kv-tier` without Ray: its flags, which replica serves a
turn, how a turn's prompt grows from the last turn's, the hit rate and the transcripts'
comparison."""

from __future__ import annotations

import argparse
import math

import pytest

from cluster.bench.kv_tier.chat import (
    ChatConfig,
    Messages,
    add_arguments,
    chat_config,
    converse,
    draw,
    hit_rate,
    mismatches,
    replica_for,
    summarize,
    table,
)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults_fit_and_the_system_prompt_is_capped_to_the_model() -> None:
    assert chat_config(_args(), 2048) == ChatConfig(4, 6, 256, 64, 32)
    # 6 turns of 96 tokens leave 64 of a 640-token model for the system prompt.
    assert chat_config(_args(), 640).system_len == 64
    assert chat_config(_args("--chat-turns", "0"), 2048) is None
    assert chat_config(_args("--chat-conversations", "0"), 2048) is None
    assert chat_config(_args("--chat-system-len", "0"), 2048).longest == 6 * 96


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--chat-turns", "-1"], "--chat-turns must be at least 0"),
        (["--chat-conversations", "-2"], "--chat-conversations must be at least 0"),
        (["--chat-user-len", "0"], "--chat-user-len must be at least 1"),
        (["--chat-answer-len", "-1"], "--chat-answer-len must be at least 1"),
        (["--chat-system-len", "-1"], "--chat-system-len must be at least 0"),
        (["--chat-system-len", "2000"], "--chat-system-len 2000: .* at most 1472"),
        (["--chat-turns", "30"], "--chat-turns 30 .* max_model_len"),
    ],
)
def test_bad_flags_name_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        chat_config(_args(*argv), 2048)


def test_turns_alternate_between_the_two_replicas() -> None:
    assert [replica_for(0, k) for k in range(4)] == [0, 1, 0, 1]
    assert [replica_for(1, k) for k in range(4)] == [1, 0, 1, 0]


def _answer(prompt: list[int]) -> list[int]:
    """A deterministic stand-in for the engine's greedy answer."""
    return [sum(prompt) % 97, len(prompt)]


def test_each_turn_extends_the_last_turns_prompt_and_answer() -> None:
    msgs = Messages([1, 2, 3], [[[10, 11], [12, 13], [14, 15]], [[20, 21], [22, 23], [24, 25]]])
    seen: list[tuple[int, list[int]]] = []
    answered: list[tuple[int, list[int]]] = []

    def generate(r: int, prompt: list[int]) -> dict:
        seen.append((r, prompt))
        return {"tokens": _answer(prompt), "cached_tokens": 3, "pulled_blocks": 0, "ttft_s": 0.1}

    turns = converse(msgs, generate, lambda r, ctx: answered.append((r, ctx)))
    assert [t["replica"] for t in turns] == [0, 1, 0, 1, 0, 1]
    assert [t["prompt_tokens"] for t in turns] == [5, 9, 13, 5, 9, 13]
    p0, p1 = seen[0][1], seen[1][1]
    assert p0 == [1, 2, 3, 10, 11]
    assert p1 == p0 + _answer(p0) + [12, 13]
    assert seen[3][1] == [1, 2, 3, 20, 21]  # a new conversation starts from the system prompt
    assert answered[1] == (1, p1 + _answer(p1))
    assert turns[1]["tokens"] == _answer(p1)


def test_draw_is_seeded_and_sized() -> None:
    cfg = ChatConfig(2, 3, 5, 4, 2)
    a, b = draw(cfg, 0, list(range(100))), draw(cfg, 0, list(range(100)))
    assert a == b and a != draw(cfg, 1, list(range(100)))
    assert len(a.system) == 5 and [len(u) for c in a.users for u in c] == [4] * 6


def _turn(k: int, prompt: int, cached: int, tokens: list[int], **kw: object) -> dict:
    return {
        "conversation": 0,
        "turn": k,
        "replica": k % 2,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "pulled_blocks": 0,
        "outcome": None,
        "ttft_s": 0.01 * (k + 1),
        "tokens": tokens,
        **kw,
    }


def test_hit_rate_sums_tokens_over_turns() -> None:
    assert hit_rate([_turn(0, 100, 0, []), _turn(1, 300, 200, [])]) == 0.5
    assert math.isnan(hit_rate([]))


def test_transcripts_are_compared_turn_by_turn() -> None:
    today = [_turn(0, 10, 0, [1, 2]), _turn(1, 14, 0, [3, 4])]
    assert mismatches(today, [dict(t) for t in today]) == []
    tier = [_turn(0, 10, 0, [1, 2]), _turn(1, 14, 0, [3, 5])]
    (bad,) = mismatches(today, tier)
    assert "turn 1" in bad and "[3, 5]" in bad
    assert mismatches(today, tier[:1]) == ["chat: 1 turns with the tier, 2 today"]


def test_summary_ratios_and_table() -> None:
    cfg = ChatConfig(1, 2, 8, 4, 2)
    today = [_turn(0, 12, 0, [1, 2]), _turn(1, 18, 0, [3, 4])]
    tier = [
        _turn(0, 12, 0, [1, 2], outcome="miss"),
        _turn(1, 18, 15, [3, 4], pulled_blocks=3, outcome="pulled", ttft_s=0.005),
    ]
    got = summarize(cfg, today, tier)
    assert got["today"]["hit_rate"] == 0 and got["tier"]["hit_rate"] == 0.5
    assert math.isnan(got["hit_rate_ratio"])  # nothing cached today: no ratio
    assert got["tier"]["pulled_turns"] == 1 and got["tier"]["outcomes"] == {"miss": 1, "pulled": 1}
    assert got["tier"]["hit_rate_by_turn"] == [0, 15 / 18]
    assert got["outputs_match"] and "tokens" not in got["samples"]["tier"][0]
    today[1]["cached_tokens"] = 6
    got = summarize(cfg, today, tier)
    assert got["hit_rate_ratio"] == 0.5 / 0.2
    text = table(got)
    assert "2.50x" in text and "(c + k) % 2" in text and "1 of 2" in text

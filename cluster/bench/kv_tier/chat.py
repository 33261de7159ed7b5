"""The multi-turn chat part of `kvray bench kv-tier`: the prefix-hit rate of a chat workload
on 2 replicas, today (no tier) and with the cluster KV tier.

C conversations of T turns share a system prompt of S random tokens; each turn appends a
user message of U random tokens to the previous turn's prompt and answer, and the answer is
A greedy tokens (ignore_eos). Turn k of conversation c goes to replica (c + k) % 2: the
turns alternate between the replicas, as a load balancer without cache affinity spreads
them, so a replica sees every other turn of a conversation. Conversations run one after
another, their turns in order; the random tokens come from a seeded RNG of their own, so
the arms' prompts do not depend on these flags.

The same conversations run twice: **today** on 2 replicas without the tier (their engines
never call `KvShare.attach`: what kvray does today) and **with the tier** on 2 replicas with
the tier attached and the learned cost model. All engines are configured alike (host tier,
KV events, block export). With the tier, the next turn waits (untimed, a user's think time)
until the last turn's blocks are in the directory. Per run: the prefix-hit rate, Σ cached
prompt tokens / Σ prompt tokens over all turns, where cached is the engine's
`RequestOutput.num_cached_tokens`: the tokens it did not compute, device prefix-cache hits
and host-tier restores, which is where pulled blocks enter (workers/core/kv_share.py), so
pulled tokens are in it already. And TTFT p50 / p99 (inside the replica, the pull included)
and the turns that pulled. Every turn's greedy answer must be the same in both runs (each
run builds its prompts from its own answers, so the whole transcripts are compared).

Pure logic here; the Ray glue is `run_chat`. No torch here (reachable from `kvray --help`).
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from cluster.bench.kv_tier.report import percentile

REPLICAS = 2
DEFAULT_SYSTEM_LEN = 256
# The target for the tier's prefix-hit rate, as a multiple of today's.
TARGET_HIT_RATIO = 1.5
# How long a turn waits for the last turn's blocks to reach the directory.
PUBLISH_WAIT_S = 20.0


@dataclass(frozen=True)
class ChatConfig:
    conversations: int
    turns: int
    system_len: int
    user_len: int
    answer_len: int

    @property
    def longest(self) -> int:
        """Tokens of a conversation's last turn: its prompt and its answer."""
        return self.system_len + self.turns * (self.user_len + self.answer_len)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--chat-conversations", type=int, default=4, help="chat conversations (default 4)")
    a("--chat-turns", type=int, default=6, help="turns per conversation (default 6; 0: no chat)")
    a(
        "--chat-system-len",
        type=int,
        default=None,
        help=f"tokens of the shared system prompt (default {DEFAULT_SYSTEM_LEN}, less where "
        "the conversation would not fit the model)",
    )
    a("--chat-user-len", type=int, default=64, help="tokens of each user message (default 64)")
    a("--chat-answer-len", type=int, default=32, help="tokens of each answer (default 32)")


def chat_config(args: argparse.Namespace, limit: int) -> ChatConfig | None:
    """The chat's sizes from the flags, checked against the model's max_model_len `limit`;
    None when there is no chat (0 conversations or turns). SystemExit names a bad flag."""
    for flag in ("conversations", "turns"):
        if getattr(args, f"chat_{flag}") < 0:
            raise SystemExit(f"--chat-{flag} must be at least 0")
    for flag in ("user_len", "answer_len"):
        if getattr(args, f"chat_{flag}") < 1:
            raise SystemExit(f"--chat-{flag.replace('_', '-')} must be at least 1")
    if args.chat_system_len is not None and args.chat_system_len < 0:
        raise SystemExit("--chat-system-len must be at least 0")
    if not args.chat_conversations or not args.chat_turns:
        return None
    turns = args.chat_turns * (args.chat_user_len + args.chat_answer_len)
    if turns > limit:
        raise SystemExit(
            f"--chat-turns {args.chat_turns} of --chat-user-len {args.chat_user_len} + "
            f"--chat-answer-len {args.chat_answer_len} tokens ({turns}) exceed the model's "
            f"max_model_len ({limit})"
        )
    system = args.chat_system_len
    if system is None:
        system = min(DEFAULT_SYSTEM_LEN, limit - turns)
    elif system + turns > limit:
        raise SystemExit(
            f"--chat-system-len {system}: the system prompt and {args.chat_turns} turns "
            f"({turns} tokens) exceed the model's max_model_len ({limit}), so at most "
            f"{limit - turns}"
        )
    return ChatConfig(
        args.chat_conversations, args.chat_turns, system, args.chat_user_len, args.chat_answer_len
    )


def replica_for(conversation: int, turn: int) -> int:
    """The replica that serves a turn: round robin, no cache affinity (module doc)."""
    return (conversation + turn) % REPLICAS


@dataclass(frozen=True)
class Messages:
    system: list[int]
    users: list[list[list[int]]]  # [conversation][turn]


def draw(cfg: ChatConfig, seed: int, ids: Sequence[int]) -> Messages:
    rng = random.Random(f"kv-tier-chat-{seed}")
    system = rng.choices(ids, k=cfg.system_len)
    users = [
        [rng.choices(ids, k=cfg.user_len) for _ in range(cfg.turns)]
        for _ in range(cfg.conversations)
    ]
    return Messages(system, users)


# generate(replica index, prompt) -> the replica's sample (TierReplica.generate's result)
Generate = Callable[[int, list[int]], dict[str, Any]]
# answered(replica index, the turn's prompt + answer): after each turn (the tier's wait)
Answered = Callable[[int, list[int]], None]


def converse(msgs: Messages, generate: Generate, answered: Answered | None = None) -> list[dict]:
    """Every turn of every conversation, in order; each turn's record (its answer in
    "tokens"). A turn's prompt is the last turn's prompt and answer plus its user message."""
    out = []
    for c, users in enumerate(msgs.users):
        context = list(msgs.system)
        for k, user in enumerate(users):
            prompt = context + user
            r = replica_for(c, k)
            s = generate(r, prompt)
            out.append(
                {
                    "conversation": c,
                    "turn": k,
                    "replica": r,
                    "prompt_tokens": len(prompt),
                    "cached_tokens": s.get("cached_tokens") or 0,
                    "pulled_blocks": s.get("pulled_blocks", 0),
                    "outcome": s.get("outcome"),
                    "ttft_s": s.get("ttft_s"),
                    "tokens": list(s["tokens"]),
                }
            )
            context = prompt + list(s["tokens"])
            if answered is not None:
                answered(r, context)
    return out


def hit_rate(turns: Sequence[dict]) -> float:
    """Σ cached prompt tokens / Σ prompt tokens."""
    prompt = sum(t["prompt_tokens"] for t in turns)
    return sum(t["cached_tokens"] for t in turns) / prompt if prompt else math.nan


def mismatches(today: Sequence[dict], tier: Sequence[dict]) -> list[str]:
    """Where the two runs' transcripts differ: a turn's prompt length or answer."""
    if len(today) != len(tier):
        return [f"chat: {len(tier)} turns with the tier, {len(today)} today"]
    return [
        f"chat conversation {a['conversation']}, turn {a['turn']}: with the tier "
        f"{b['tokens']} after {b['prompt_tokens']} prompt tokens, today {a['tokens']} after "
        f"{a['prompt_tokens']}"
        for a, b in zip(today, tier, strict=True)
        if a["tokens"] != b["tokens"] or a["prompt_tokens"] != b["prompt_tokens"]
    ]


def run_stats(turns: Sequence[dict]) -> dict[str, Any]:
    ttft = [t["ttft_s"] * 1e3 for t in turns if t["ttft_s"] is not None]
    by_turn = sorted({t["turn"] for t in turns})
    return {
        "turns": len(turns),
        "prompt_tokens": sum(t["prompt_tokens"] for t in turns),
        "cached_tokens": sum(t["cached_tokens"] for t in turns),
        "hit_rate": hit_rate(turns),
        "hit_rate_by_turn": [hit_rate([t for t in turns if t["turn"] == k]) for k in by_turn],
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "pulled_turns": sum(1 for t in turns if t["pulled_blocks"]),
        "pulled_blocks": sum(t["pulled_blocks"] for t in turns),
    }


def summarize(cfg: ChatConfig, today: Sequence[dict], tier: Sequence[dict]) -> dict[str, Any]:
    """The chat's result: each run's figures, the ratios, whether the transcripts match and
    every turn's record (answers left out: compared here)."""
    a, b = run_stats(today), run_stats(tier)
    bad = mismatches(today, tier)
    outcomes = [t["outcome"] for t in tier]
    b["outcomes"] = {o: outcomes.count(o) for o in sorted(set(outcomes), key=str)}
    return {
        **asdict(cfg),
        "replicas": REPLICAS,
        "today": a,
        "tier": b,
        "hit_rate_ratio": _div(b["hit_rate"], a["hit_rate"]),
        "ttft_p50_ratio": _div(b["ttft_p50_ms"], a["ttft_p50_ms"]),
        "ttft_p99_ratio": _div(b["ttft_p99_ms"], a["ttft_p99_ms"]),
        "outputs_match": not bad,
        "mismatches": bad,
        "samples": {
            run: [{k: v for k, v in t.items() if k != "tokens"} for t in turns]
            for run, turns in (("today", today), ("tier", tier))
        },
    }


def _div(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) else math.nan


def table(chat: dict[str, Any]) -> str:
    lines = [
        f"multi-turn chat: {chat['conversations']} conversations x {chat['turns']} turns, "
        f"{chat['system_len']}-token system prompt, {chat['user_len']}-token user messages, "
        f"{chat['answer_len']}-token answers; turn k of conversation c on replica (c + k) % 2 "
        "(round robin, no cache affinity)",
        f"{'run':>10} {'prompt tok':>11} {'cached tok':>11} {'hit rate':>9} "
        f"{'TTFT p50 / p99 ms':>20} {'turns pulled':>13}  hit rate by turn",
    ]
    for run, label in (("today", "today"), ("tier", "with tier")):
        s = chat[run]
        ttft = f"{s['ttft_p50_ms']:.1f} / {s['ttft_p99_ms']:.1f}"
        by_turn = " ".join(f"{x:.2f}" for x in s["hit_rate_by_turn"])
        lines.append(
            f"{label:>10} {s['prompt_tokens']:>11} {s['cached_tokens']:>11} "
            f"{s['hit_rate']:>9.3f} {ttft:>20} {s['pulled_turns']:>6} of {s['turns']:<4}  "
            f"{by_turn}"
        )
    lines.append(
        f"hit rate with the tier / today: {chat['hit_rate_ratio']:.2f}x (target: "
        f">= {TARGET_HIT_RATIO}x); TTFT with the tier / today: p50 {chat['ttft_p50_ratio']:.2f}x, "
        f"p99 {chat['ttft_p99_ratio']:.2f}x"
    )
    return "\n".join(lines)


def run_chat(cfg: ChatConfig, seed: int, ids: Sequence[int], today: list, tier: list) -> dict:
    """The chat on the replicas (Ray actors of TierReplica): `today`, 2 without the tier,
    `tier`, 2 with it and the learned cost model; the summary."""
    import ray

    msgs = draw(cfg, seed, ids)

    def on(pair: list) -> Generate:
        return lambda r, prompt: ray.get(pair[r].generate.remote(prompt, cfg.answer_len))

    def published(r: int, context: list[int]) -> None:
        ray.get(tier[r].wait_published.remote(context, PUBLISH_WAIT_S))

    return summarize(cfg, converse(msgs, on(today)), converse(msgs, on(tier), published))

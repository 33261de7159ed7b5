"""The mixed workload of `kvray bench serve --chaos`: what each request asks, drawn from a seed.

Request i is a pure function of (seed, i) (`request_at`): the bench sends requests 0, 1, 2, ...
as fast as its workers free up, so how many are sent depends on the server, but request i is
the same in every run with the same seed and flags. The mix, in fixed shares:

- API: /v1/completions (token-id prompts) or /v1/chat/completions (a user message of plain
  words, rendered by the checkpoint's chat template), half each; streamed or not, half each;
- sampling: greedy (temperature 0) or seeded (temperature 0.8, top_p 0.95, a seed of its
  own), half each: both reproducible, so every finished request has one right answer;
- structured: a fifth of the requests are constrained by a small JSON schema
  (`response_format: json_schema`, schemas a weak model finishes within STRUCTURED_MAX_TOKENS);
  the others are free text with ignore_eos, exactly max_tokens long;
- priority: drawn from `--chaos-priorities` (default -1, 0, 5 with shares 0.2, 0.6, 0.2);
- tenant: one of `--chaos-tenants`, each equally likely.

Kept free of torch imports: reachable from `kvray --help`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cluster.bench.throughput.structured import SCHEMAS

# Schemas whose strings and numbers are bounded tightly enough that the demo model closes
# every object well within STRUCTURED_MAX_TOKENS (the others may run into their cap).
STRUCTURED_SCHEMAS = ("person", "tool_call")
STRUCTURED_MAX_TOKENS = 96
SEEDED_SAMPLING = {"temperature": 0.8, "top_p": 0.95}
# Words of the chat messages: plain ASCII, so every tokenizer has them.
WORDS = (
    "river", "stone", "light", "paper", "window", "garden", "music", "winter", "orange", "train",
    "bridge", "cloud", "summer", "forest", "letter", "market", "silver", "morning", "table",
    "answer", "number", "simple", "story", "yellow", "quiet", "engine", "harbor", "signal",
    "copper", "island", "planet", "kitchen",
)  # fmt: skip
DEFAULT_PRIORITIES = "-1:0.2,0:0.6,5:0.2"


@dataclass(frozen=True)
class ChaosMix:
    """How requests are drawn: the flags' part of the mix (the API, stream, sampling and
    structured shares are the module's fixed ones)."""

    tenants: int = 3
    priorities: tuple[tuple[int, float], ...] = ((-1, 0.2), (0, 0.6), (5, 0.2))
    output_len: tuple[int, int] = (16, 128)
    input_len: tuple[int, int] = (8, 128)  # completions' prompt tokens
    chat_share: float = 0.5
    stream_share: float = 0.5
    seeded_share: float = 0.5
    structured_share: float = 0.2

    def __post_init__(self) -> None:
        if self.tenants < 1:
            raise ValueError(f"--chaos-tenants must be >= 1, got {self.tenants}")
        for flag, (lo, hi) in (("--chaos-output-len", self.output_len),
                               ("--input-len", self.input_len)):  # fmt: skip
            if not 1 <= lo <= hi:
                raise ValueError(f"{flag} must give 1 <= MIN <= MAX, got {lo} {hi}")
        if not self.priorities or any(w <= 0 for _, w in self.priorities):
            raise ValueError("--chaos-priorities needs PRIORITY:SHARE pairs with shares > 0")


@dataclass(frozen=True)
class ChaosRequest:
    index: int
    api: str  # "completions" | "chat"
    stream: bool
    max_tokens: int
    priority: int
    tenant: int
    seed: int | None = None  # None: greedy
    schema: str = ""  # a STRUCTURED_SCHEMAS name, "" = free text (ignore_eos)
    prompt_ids: tuple[int, ...] = ()  # completions
    message: str = ""  # chat: the user message

    @property
    def structured(self) -> bool:
        return bool(self.schema)

    @property
    def sampling(self) -> dict[str, Any]:
        """The request's sampling fields (the same on the wire and offline)."""
        if self.seed is None:
            return {"temperature": 0.0}
        return {**SEEDED_SAMPLING, "seed": self.seed}

    def schema_dict(self) -> dict[str, Any] | None:
        return SCHEMAS[self.schema] if self.schema else None

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.message}]

    def describe(self) -> str:
        kind = f"{self.api}{' stream' if self.stream else ''}"
        how = "greedy" if self.seed is None else f"seed {self.seed}"
        what = f"schema {self.schema}" if self.schema else f"{self.max_tokens} tokens"
        where = f"priority {self.priority}, tenant {self.tenant}"
        return f"#{self.index} {kind}, {how}, {what}, {where}"


def parse_priorities(text: str) -> tuple[tuple[int, float], ...]:
    """'-1:0.2,0:0.6,5:0.2' -> ((-1, 0.2), (0, 0.6), (5, 0.2)); ValueError naming the flag."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        prio, sep, share = part.rpartition(":")
        try:
            if not sep:
                raise ValueError
            out.append((int(prio), float(share)))
        except ValueError:
            raise ValueError(
                f"--chaos-priorities must be PRIORITY:SHARE[,...], got {text!r}"
            ) from None
    if not out or any(w <= 0 for _, w in out) or len({p for p, _ in out}) != len(out):
        raise ValueError(f"--chaos-priorities needs distinct priorities, shares > 0: {text!r}")
    return tuple(out)


def request_at(mix: ChaosMix, seed: int, index: int, token_ids: Sequence[int]) -> ChaosRequest:
    """Request `index` of the run with `seed`: the same for the same arguments, always."""
    rng = random.Random(seed * 1_000_003 + index)
    api = "chat" if rng.random() < mix.chat_share else "completions"
    stream = rng.random() < mix.stream_share
    seeded = rng.random() < mix.seeded_share
    schema = ""
    if rng.random() < mix.structured_share:
        schema = STRUCTURED_SCHEMAS[rng.randrange(len(STRUCTURED_SCHEMAS))]
    prios, weights = zip(*mix.priorities, strict=True)
    priority = rng.choices(prios, weights=weights)[0]
    tenant = rng.randrange(mix.tenants)
    max_tokens = STRUCTURED_MAX_TOKENS if schema else rng.randint(*mix.output_len)
    prompt_ids: tuple[int, ...] = ()
    message = ""
    if api == "completions":
        prompt_ids = tuple(rng.choices(token_ids, k=rng.randint(*mix.input_len)))
    else:
        message = " ".join(rng.choices(WORDS, k=rng.randint(4, 24)))
    return ChaosRequest(
        index=index,
        api=api,
        stream=stream,
        max_tokens=max_tokens,
        priority=priority,
        tenant=tenant,
        seed=rng.randrange(1, 2**31) if seeded else None,
        schema=schema,
        prompt_ids=prompt_ids,
        message=message,
    )


def http_request(req: ChaosRequest, model: str) -> tuple[str, dict[str, Any]]:
    """(route under /v1, JSON body) of a request over the OpenAI HTTP API."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.max_tokens,
        "priority": req.priority,
        "stream": req.stream,
        **req.sampling,
    }
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if req.structured:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": req.schema, "schema": req.schema_dict()},
        }
    else:
        body["ignore_eos"] = True  # free text: exactly max_tokens long
    if req.api == "chat":
        return "/v1/chat/completions", {**body, "messages": req.messages()}
    return "/v1/completions", {**body, "prompt": list(req.prompt_ids)}


def describe_mix(mix: ChaosMix) -> dict[str, Any]:
    """The mix as the report's JSON shows it."""
    return {
        "tenants": mix.tenants,
        "priorities": {str(p): w for p, w in mix.priorities},
        "output_len_range": list(mix.output_len),
        "input_len_range": list(mix.input_len),
        "chat_share": mix.chat_share,
        "stream_share": mix.stream_share,
        "seeded_share": mix.seeded_share,
        "structured_share": mix.structured_share,
        "structured_schemas": {n: json.dumps(SCHEMAS[n]) for n in STRUCTURED_SCHEMAS},
        "structured_max_tokens": STRUCTURED_MAX_TOKENS,
    }

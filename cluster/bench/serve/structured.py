"""`kvray bench serve --workload json-schema`: constrained vs unconstrained over a server.

The online twin of `kvray bench throughput --workload json-schema` (throughput/structured.py,
whose SCHEMAS it reuses). Each round, on each backend:

1. constrained: random prompts, request i constrained to schema i mod len(SCHEMAS) (HTTP
   `response_format: json_schema`, gRPC `SamplingParams.json_schema`, in-process
   `SamplingParams.structured_outputs`), greedy, max_tokens = MAX_TOKENS as a cap: each ends
   when its grammar does;
2. unconstrained: the same prompts, each with ignore_eos and max_tokens = what its constrained
   twin generated, so both runs generate the same tokens per request. Only the first prompt
   token differs, so no block of it is served from the prefix cache the constrained run filled
   (a hit would flatter the unconstrained TTFT).

Grammars are compiled before the first round (one untimed request per schema and replica), so
the figures are the issue's "once grammars are cached" case. Reported per backend: output
tok/s and median TTFT of both, and constrained/unconstrained ratios (median over rounds; the
goal: output throughput >= 0.9).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
from collections.abc import Sequence
from typing import Any

from cluster.bench.common.backend_types import Backend, RequestRecord
from cluster.bench.common.workload import BenchRequest, Measure, Workload
from cluster.bench.serve.salt import salt_workload
from cluster.bench.throughput.structured import MAX_TOKENS, SCHEMAS

WORKLOAD = "json-schema"
CONSTRAINED, UNCONSTRAINED = "json-schema", "unconstrained"
# Separators as StructuredOutputs.from_schema writes them: every backend sends the same text.
_SCHEMA_TEXT = tuple(json.dumps(s, separators=(",", ":")) for s in SCHEMAS.values())


def structured_workload(
    token_ids: Sequence[int], *, num_prompts: int, input_len: int, seed: int
) -> Workload:
    """num_prompts random prompts of input_len tokens, request i constrained to schema i mod
    len(SCHEMAS), MAX_TOKENS at most."""
    if num_prompts < 1 or input_len < 1:
        raise ValueError("need --num-prompts >= 1 and --input-len >= 1")
    rng = random.Random(seed)
    requests = tuple(
        BenchRequest(
            tuple(rng.choices(token_ids, k=input_len)),
            MAX_TOKENS,
            _SCHEMA_TEXT[i % len(_SCHEMA_TEXT)],
        )
        for i in range(num_prompts)
    )
    params = {
        "schemas": list(SCHEMAS),
        "input_len": input_len,
        "max_tokens": MAX_TOKENS,
        "seed": seed,
    }
    return Workload(WORKLOAD, requests, params)


class LengthRecorder:
    """A backend that notes each request's output length (keyed by prompt), so the
    unconstrained twin can ask for exactly as many tokens."""

    def __init__(self, backend: Backend) -> None:
        self.name = backend.name
        self._backend = backend
        self.lengths: dict[tuple[int, ...], int] = {}

    async def send(self, req: BenchRequest) -> RequestRecord:
        rec = await self._backend.send(req)
        if rec.ok:
            self.lengths[req.prompt_ids] = rec.output_len
        return rec

    async def close(self) -> None:
        await self._backend.close()


def unconstrained_twin(
    workload: Workload,
    lengths: dict[tuple[int, ...], int],
    token_ids: Sequence[int],
    first_token: int | None = None,
) -> Workload:
    """The same requests, free text, each as long as its constrained twin's output (the cap
    where that failed). The first prompt token is swapped for another id (`first_token`, where
    given and not the prompt's own), so the twin shares no prefix-cache block with the
    constrained run."""
    requests = []
    for r in workload.requests:
        other = first_token if first_token is not None else token_ids[0]
        if other == r.prompt_ids[0]:
            other = token_ids[0] if r.prompt_ids[0] != token_ids[0] else token_ids[1]
        requests.append(
            BenchRequest((other,) + r.prompt_ids[1:], lengths.get(r.prompt_ids, r.output_len))
        )
    return Workload(UNCONSTRAINED, tuple(requests), workload.params)


def grammar_warmup(token_ids: Sequence[int], copies: int, seed: int) -> Workload:
    """One constrained request per schema, `copies` times (one per replica, roughly): fills
    the compile caches before anything is timed. Prompts of their own (seed far from rounds)."""
    rng = random.Random(seed + 1_000_003)
    requests = tuple(
        BenchRequest(tuple(rng.choices(token_ids, k=16)), MAX_TOKENS, text)
        for _ in range(max(1, copies))
        for text in _SCHEMA_TEXT
    )
    return Workload("json-schema-warmup", requests, {})


async def structured_rounds(
    args: argparse.Namespace,
    workloads: Sequence[Workload],
    backends: Sequence[tuple[str, Any]],
    token_ids: Sequence[int],
    measure: Measure,
    group: str = "",
) -> list[dict[str, Any]]:
    """Every backend once per round: constrained, then its unconstrained twin. Backend i's
    constrained prompts start with token_ids[2i], its twin's with token_ids[2i + 1]: no run
    finds its prompts in the prefix cache another backend's run filled on the same server."""
    warm = grammar_warmup(token_ids, getattr(args, "num_replicas", 1) or 1, args.seed)
    for _, backend in backends:
        await asyncio.gather(*(backend.send(req) for req in warm.requests))
    summaries = []
    for r, workload in enumerate(workloads):
        for i, (label, backend) in enumerate(backends):
            recorder = LengthRecorder(backend)
            salted = salt_workload(workload, 2 * i, token_ids)
            c = await measure(f"{label} {CONSTRAINED}", recorder, args, salted, r)
            first = token_ids[(2 * i + 1) % len(token_ids)]
            twin = unconstrained_twin(salted, recorder.lengths, token_ids, first)
            u = await measure(f"{label} {UNCONSTRAINED}", backend, args, twin, r)
            c["finished_by_grammar"] = sum(n < MAX_TOKENS for n in recorder.lengths.values())
            for s, kind in ((c, CONSTRAINED), (u, UNCONSTRAINED)):
                s.update(group=group, base_backend=label, structured=kind)
            summaries += [c, u]
    return summaries


def compare_structured(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per backend: constrained/unconstrained output throughput and median TTFT, each round's
    pair (same round, same backend) and their median over rounds."""
    pairs: dict[str, dict[int, dict[str, dict[str, Any]]]] = {}
    for s in summaries:
        if "structured" in s:
            by_round = pairs.setdefault(s["base_backend"], {})
            by_round.setdefault(s.get("round", 0), {})[s["structured"]] = s
    out: dict[str, Any] = {}
    for backend, by_round in pairs.items():
        tput, ttft, c_tok, u_tok, c_ttft, u_ttft = [], [], [], [], [], []
        for pair in by_round.values():
            c, u = pair.get(CONSTRAINED), pair.get(UNCONSTRAINED)
            if c is None or u is None or not u["output_throughput"]:
                continue
            c_tok.append(c["output_throughput"])
            u_tok.append(u["output_throughput"])
            c_ttft.append(c["ttft_ms"]["median"])
            u_ttft.append(u["ttft_ms"]["median"])
            tput.append(c_tok[-1] / u_tok[-1])
            if u_ttft[-1]:
                ttft.append(c_ttft[-1] / u_ttft[-1])
        if tput:
            out[backend] = {
                "rounds": len(tput),
                "constrained_output_tok_s": statistics.median(c_tok),
                "unconstrained_output_tok_s": statistics.median(u_tok),
                "constrained_ttft_median_ms": statistics.median(c_ttft),
                "unconstrained_ttft_median_ms": statistics.median(u_ttft),
                "output_throughput_ratio": statistics.median(tput),
                "ttft_ratio": statistics.median(ttft) if ttft else float("nan"),
                "output_throughput_ratios": tput,
            }
    return out


def format_structured(comparison: dict[str, Any]) -> str:
    rows = [
        "constrained (json-schema) vs unconstrained, same prompts and output lengths; "
        "each figure the median over rounds, each ratio the median of the rounds' ratios:"
    ]
    for backend, c in comparison.items():
        spread = ""
        if c["rounds"] > 1:
            lo, hi = min(c["output_throughput_ratios"]), max(c["output_throughput_ratios"])
            spread = f" ({c['rounds']} rounds, {lo:.2f}-{hi:.2f}x)"
        rows.append(
            f"  {backend}: output tok/s {c['constrained_output_tok_s']:.1f} vs "
            f"{c['unconstrained_output_tok_s']:.1f} = {c['output_throughput_ratio']:.2f}x "
            f"(target >= 0.90){spread}; median TTFT {c['constrained_ttft_median_ms']:.1f} vs "
            f"{c['unconstrained_ttft_median_ms']:.1f} ms = {c['ttft_ratio']:.2f}x"
        )
    return "\n".join(rows)

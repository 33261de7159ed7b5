"""`kvray bench serve --workload json-schema`: the workload, the twin runs, the comparison.

No server: the rounds run through serve.measure against a backend defined here that answers
the way a server does for the two kinds of request (a constrained one stops where its grammar
would, a free one runs to max_tokens). The real backends are run in test_serve.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from cluster.bench.common.backend_types import RequestRecord
from cluster.bench.common.workload import BenchRequest
from cluster.bench.serve import main as bench_serve
from cluster.bench.serve.structured import (
    MAX_TOKENS,
    compare_structured,
    format_structured,
    structured_rounds,
    structured_workload,
    unconstrained_twin,
)
from cluster.bench.serve.workload import build_workload
from cluster.bench.throughput.structured import SCHEMAS

TOKENS = list(range(100, 300))
ARGV = ("--workload", "json-schema", "--num-prompts", "9", "--input-len", "12")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_workload_cycles_the_schemas_and_is_seeded() -> None:
    args = _args(*ARGV)
    w = build_workload(args, TOKENS)
    assert w.name == "json-schema" and len(w.requests) == 9
    assert all(r.prompt_len == 12 and r.output_len == MAX_TOKENS for r in w.requests)
    names = list(SCHEMAS)
    for i, r in enumerate(w.requests):
        assert json.loads(r.json_schema) == SCHEMAS[names[i % len(names)]]
    assert build_workload(args, TOKENS) == w
    assert build_workload(_args(*ARGV, "--seed", "1"), TOKENS) != w
    with pytest.raises(ValueError):
        structured_workload(TOKENS, num_prompts=0, input_len=4, seed=0)


def test_twin_same_prompts_and_lengths_but_no_shared_prefix_block() -> None:
    w = structured_workload(TOKENS, num_prompts=5, input_len=8, seed=3)
    lengths = {r.prompt_ids: 10 + i for i, r in enumerate(w.requests[:4])}  # the 5th failed
    twin = unconstrained_twin(w, lengths, TOKENS)
    assert [r.output_len for r in twin.requests] == [10, 11, 12, 13, MAX_TOKENS]
    for r, t in zip(w.requests, twin.requests, strict=True):
        assert t.json_schema == "" and t.prompt_len == r.prompt_len
        assert t.prompt_ids[1:] == r.prompt_ids[1:] and t.prompt_ids[0] != r.prompt_ids[0]
        assert t.prompt_ids[0] in TOKENS


class _AnswersLikeAServer:
    """Constrained: stops after a length its schema determines (as a grammar would); free:
    exactly max_tokens. Constrained requests are slower to start, as a mask costs time."""

    name = "toy"

    def __init__(self) -> None:
        self.sent: list[BenchRequest] = []

    async def send(self, req: BenchRequest) -> RequestRecord:
        self.sent.append(req)
        n = 7 + len(req.json_schema) % 13 if req.json_schema else req.output_len
        await asyncio.sleep(0.002 if req.json_schema else 0.001)
        return RequestRecord(ok=True, prompt_len=req.prompt_len, output_len=n, ttft=0.01, e2e=0.02)

    async def close(self) -> None:
        pass


def test_rounds_pair_each_constrained_run_with_its_twin() -> None:
    argv = ("--workload", "json-schema", "--num-prompts", "6", "--input-len", "8")
    args = _args(*argv, "--rounds", "2")
    workloads = [build_workload(_args(*argv, "--seed", str(r)), TOKENS) for r in (0, 1)]
    backend = _AnswersLikeAServer()
    summaries = asyncio.run(
        structured_rounds(args, workloads, [("toy", backend)], TOKENS, bench_serve.measure)
    )
    # Grammar warm-up first: one constrained request per schema, before anything is timed.
    assert [r.json_schema != "" for r in backend.sent[: len(SCHEMAS)]] == [True] * len(SCHEMAS)
    labels = [(s["backend"], s["round"]) for s in summaries]
    assert labels == [
        ("toy json-schema", 0), ("toy unconstrained", 0),
        ("toy json-schema", 1), ("toy unconstrained", 1),
    ]  # fmt: skip
    for c, u in zip(summaries[::2], summaries[1::2], strict=True):
        assert c["completed"] == u["completed"] == 6
        assert c["output_tokens"] == u["output_tokens"] < 6 * MAX_TOKENS
        assert c["finished_by_grammar"] == 6
        assert (c["structured"], u["structured"]) == ("json-schema", "unconstrained")
    comparison = compare_structured(summaries)
    assert list(comparison) == ["toy"] and comparison["toy"]["rounds"] == 2


def _summary(backend: str, kind: str, round_: int, tok_s: float, ttft: float) -> dict:
    return {
        "backend": f"{backend} {kind}",
        "base_backend": backend,
        "structured": kind,
        "round": round_,
        "output_throughput": tok_s,
        "ttft_ms": {"median": ttft},
    }


def test_compare_takes_per_round_ratios_and_their_median() -> None:
    summaries = [
        _summary("http", "json-schema", 0, 90.0, 30.0),
        _summary("http", "unconstrained", 0, 100.0, 20.0),
        _summary("http", "json-schema", 1, 40.0, 30.0),  # a slow round: both sides slow
        _summary("http", "unconstrained", 1, 50.0, 30.0),
        _summary("http", "json-schema", 2, 95.0, 10.0),
        _summary("http", "unconstrained", 2, 100.0, 10.0),
        _summary("grpc", "json-schema", 0, 10.0, 5.0),  # no twin: not compared
        {"backend": "inprocess", "round": 0, "output_throughput": 1.0},  # another workload's
    ]
    c = compare_structured(summaries)
    assert list(c) == ["http"]
    assert c["http"]["output_throughput_ratios"] == [0.9, 0.8, 0.95]
    assert c["http"]["output_throughput_ratio"] == 0.9
    assert c["http"]["ttft_ratio"] == 1.0  # median of 1.5, 1.0, 1.0
    assert c["http"]["constrained_output_tok_s"] == 90.0
    text = format_structured(c)
    assert "http: output tok/s 90.0 vs 100.0 = 0.90x" in text and "0.80-0.95x" in text

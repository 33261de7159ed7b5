"""`kvray bench serve` with several backends on one server: each starts from the same
prefix-cache state (none of another backend's prompts), so their TTFT and throughput compare.

No server: two backends defined here talk to one fake server whose prefix cache works as the
engine's does (full blocks, hashes chained from the first token); the rounds run through
serve._rounds and serve.measure as a real run does.
"""

from __future__ import annotations

import argparse
import asyncio

from cluster.bench.common.backend_types import RequestRecord
from cluster.bench.common.workload import BenchRequest
from cluster.bench.serve import main as bench_serve
from cluster.bench.serve.salt import salt_workload
from cluster.bench.serve.workload import build_workload

TOKENS = list(range(100, 400))
BLOCK = 16


class _SharedCacheServer:
    """Answers requests from a prefix cache shared by every backend connected to it."""

    def __init__(self) -> None:
        self.blocks: set[tuple[int, ...]] = set()  # a chain of full blocks = its whole prefix

    def answer(self, req: BenchRequest) -> RequestRecord:
        ids = req.prompt_ids
        # At least one prompt token is computed (as the engine does): the last full block of a
        # prompt whose length is a multiple of BLOCK is never a hit.
        full = (len(ids) - 1) // BLOCK
        cached = 0
        while cached < full and ids[: (cached + 1) * BLOCK] in self.blocks:
            cached += 1
        self.blocks.update(ids[: (n + 1) * BLOCK] for n in range(len(ids) // BLOCK))
        return RequestRecord(
            ok=True,
            prompt_len=len(ids),
            output_len=req.output_len,
            ttft=0.001,
            e2e=0.002,
            cached_tokens=cached * BLOCK,
        )


class _Backend:
    def __init__(self, name: str, server: _SharedCacheServer) -> None:
        self.name = name
        self._server = server
        self.sent: list[BenchRequest] = []

    async def send(self, req: BenchRequest) -> RequestRecord:
        self.sent.append(req)
        return self._server.answer(req)

    async def close(self) -> None:
        pass


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def _run(*argv: str) -> tuple[list[dict], list[_Backend]]:
    args = _args("--num-prompts", "12", "--input-len", "64", "--output-len", "2", *argv)
    workloads = [
        build_workload(argparse.Namespace(**{**vars(args), "seed": args.seed + r}), TOKENS)
        for r in range(args.rounds)
    ]
    server = _SharedCacheServer()
    backends = [_Backend("http", server), _Backend("grpc", server)]
    opened = [(b.name, b) for b in backends]
    summaries = asyncio.run(bench_serve._rounds(args, workloads, TOKENS, None, opened))
    return summaries, backends


def test_backends_after_the_first_find_no_prompt_of_it_in_the_prefix_cache() -> None:
    summaries, backends = _run("--rounds", "2")
    assert [(s["backend"], s["round"]) for s in summaries] == [
        ("http", 0), ("grpc", 0), ("http", 1), ("grpc", 1),
    ]  # fmt: skip
    # Random prompts: nothing to share, on any backend, in any round.
    assert [s["prefix_cache_hit_rate"] for s in summaries] == [0.0] * 4
    # Same work: the same number of prompts, each as long, on every backend.
    http, grpc = ([(r.prompt_len, r.output_len) for r in b.sent] for b in backends)
    assert http == grpc
    first_blocks = [{r.prompt_ids[:BLOCK] for r in b.sent} for b in backends]
    assert not first_blocks[0] & first_blocks[1]


def test_shared_prefix_hit_rates_are_the_same_on_every_backend() -> None:
    summaries, _ = _run("--workload", "shared-prefix", "--num-tenants", "2", "--prefix-len", "48")
    rates = {s["backend"]: s["prefix_cache_hit_rate"] for s in summaries}
    # Each backend's tenants share their system prompts within its own run, as many times.
    assert rates["http"] > 0 and rates["grpc"] == rates["http"], rates


def test_salt_keeps_lengths_and_shared_prefixes_and_sets_the_first_token() -> None:
    args = argparse.Namespace(
        workload="shared-prefix", num_prompts=20, num_tenants=3, prefix_len=32, input_len=48,
        output_len=5, zipf_s=1.0, seed=2,
    )  # fmt: skip
    w = build_workload(args, TOKENS)
    a, b = salt_workload(w, 0, TOKENS), salt_workload(w, 1, TOKENS)
    for orig, x, y in zip(w.requests, a.requests, b.requests, strict=True):
        assert (x.prompt_ids[0], y.prompt_ids[0]) == (TOKENS[0], TOKENS[1])
        assert x.prompt_ids[1:] == y.prompt_ids[1:] == orig.prompt_ids[1:]
        assert x.output_len == orig.output_len
    assert len({r.prompt_ids[:32] for r in a.requests}) == 3  # the tenants' prefixes remain

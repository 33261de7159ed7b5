"""`kvray bench serve --workload lora` (cluster/bench/serve/lora.py): the Zipf workload over
adapter names, what the launched server and the in-process engine are given, the report, and
one small real run on the in-process engine (base model, then adapters)."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import pytest

from cluster.bench.common.backend_types import RequestRecord
from cluster.bench.common.workload import BenchRequest
from cluster.bench.serve import lora as serve_lora
from cluster.bench.serve import main as bench_serve
from cluster.bench.serve.workload import build_workload

TOKENS = range(100, 400)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def _workload(n: int, s: float, seed: int = 1) -> tuple[BenchRequest, ...]:
    return serve_lora.lora_workload(
        TOKENS, num_prompts=400, input_len=12, output_len=3, num_adapters=n, zipf_s=s, seed=seed
    ).requests


def test_requests_name_adapters_with_zipf_popularity() -> None:
    counts = Counter(r.model for r in _workload(8, 1.0))
    names = serve_lora.adapter_names(8)
    assert set(counts) == set(names) and names[0] == "bench-lora-0"
    # P(k) ~ 1/(k+1): the first about twice the second, eight times the eighth.
    assert counts[names[0]] > 1.5 * counts[names[1]] and counts[names[0]] > 4 * counts[names[7]]
    uniform = Counter(r.model for r in _workload(8, 0.0))
    assert max(uniform.values()) < 2 * min(uniform.values())
    assert _workload(8, 1.0) == _workload(8, 1.0) != _workload(8, 1.0, seed=2)  # seeded
    assert {r.model for r in _workload(0, 1.0)} == {""}  # --num-adapters 0: the base model
    assert {(r.prompt_len, r.output_len) for r in _workload(3, 1.0)} == {(12, 3)}


def test_the_base_twin_has_the_same_prompts_on_the_base_model() -> None:
    w = serve_lora.lora_workload(
        TOKENS, num_prompts=20, input_len=8, output_len=2, num_adapters=3, zipf_s=1.0, seed=0
    )
    twin = serve_lora.base_twin(w)
    assert [r.prompt_ids for r in twin.requests] == [r.prompt_ids for r in w.requests]
    assert {r.model for r in twin.requests} == {""}
    args = _args("--workload", "lora", "--num-adapters", "3", "--num-prompts", "20",
                 "--input-len", "8", "--output-len", "2", "--seed", "0")  # fmt: skip
    assert build_workload(args, TOKENS) == w
    assert (args.lora_rank, args.lora_zipf_s, args.max_loras) == (16, 1.0, None)


def test_the_launched_server_and_the_inprocess_engine_get_the_adapters(tmp_path: Path) -> None:
    from cluster.config import ServeConfig
    from workers import EngineArgs

    args = _args("--workload", "lora", "--num-adapters", "2", "--lora-rank", "8", "--launch",
                 "--max-loras", "3")  # fmt: skip
    adapters = {"bench-lora-0": str(tmp_path / "a"), "bench-lora-1": str(tmp_path / "b")}
    config = ServeConfig.from_flat(**serve_lora.server_overrides(args, adapters))
    assert config.lora.enable_lora and (config.lora.max_loras, config.lora.max_lora_rank) == (3, 8)
    assert {m.name: m.path for m in config.lora.lora_modules or ()} == adapters
    engine = EngineArgs(**serve_lora.engine_overrides(args, adapters))
    assert engine.enable_lora and (engine.max_loras, engine.max_lora_rank) == (3, 8)
    assert serve_lora.server_overrides(args, {}) == serve_lora.engine_overrides(args, {}) == {}


def _summary(backend: str, kind: str, tok_s: float, ttft_ms: float, round_: int = 0) -> dict:
    return {
        "backend": f"{backend} {kind}",
        "base_backend": backend,
        "lora": kind,
        "round": round_,
        "output_throughput": tok_s,
        "ttft_ms": {"median": ttft_ms},
    }


def test_report_compares_each_round_with_its_base_run() -> None:
    summaries = [
        _summary("http", "base", 100.0, 10.0),
        _summary("http", "lora", 80.0, 14.0),
        _summary("http", "base", 120.0, 12.0, 1),
        _summary("http", "lora", 60.0, 20.0, 1),
    ]
    summaries[1]["per_adapter"] = {"bench-lora-0": {"requests": 5, "ttft_median_ms": 13.0}}
    c = serve_lora.compare_lora(summaries)["http"]
    assert c["rounds"] == 2 and c["output_throughput_ratio"] == pytest.approx((0.8 + 0.5) / 2)
    assert (c["lora_output_tok_s"], c["base_output_tok_s"]) == (70.0, 110.0)
    text = serve_lora.format_lora(summaries, {"http": c})
    assert "http: output tok/s 70.0 vs 110.0 = 0.65x" in text
    assert "bench-lora-0" in text and "5 requests" in text


def test_adapter_recorder_counts_per_adapter() -> None:
    import asyncio

    class Echo:
        name = "echo"

        async def send(self, req: BenchRequest) -> RequestRecord:
            return RequestRecord(ok=req.model != "bad", prompt_len=1, ttft=0.01 * len(req.model))

        async def close(self) -> None: ...

    rec = serve_lora.AdapterRecorder(Echo())
    for model in ("a", "a", "bb", "", "bad"):
        asyncio.run(rec.send(BenchRequest((1,), 1, model=model)))
    per = rec.per_adapter()
    assert list(per)[0] == "a" and per["a"]["requests"] == 2
    assert per["bb"]["ttft_median_ms"] == pytest.approx(20.0)
    assert per["base"]["requests"] == 1 and per["bad"]["completed"] == 0


@pytest.mark.slow
def test_small_inprocess_run(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = _args(
        "--backend", "inprocess", "--workload", "lora", "--num-adapters", "3", "--lora-rank", "4",
        "--lora-dir", str(tmp_path / "adapters"), "--max-loras", "2", "--num-prompts", "8",
        "--input-len", "20", "--output-len", "3", "--max-concurrency", "4",
        "--kv-cache-memory", str(16 << 20), "--warmup-requests", "1", "--result-json", str(out),
    )  # fmt: skip
    assert bench_serve.run(args) == 0
    result = json.loads(out.read_text())
    runs = {r["backend"]: r for r in result["runs"]}
    assert list(runs) == ["inprocess base", "inprocess lora"]
    assert all(r["completed"] == 8 and r["output_tokens"] == 8 * 3 for r in runs.values())
    per = runs["inprocess lora"]["per_adapter"]
    assert sum(a["requests"] for a in per.values()) == 8 and set(per) <= set(
        serve_lora.adapter_names(3)
    )
    assert result["comparisons"]["lora_vs_base"]["inprocess"]["rounds"] == 1
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == serve_lora.adapter_names(3)

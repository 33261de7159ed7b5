"""`kvray bench throughput`: the real command on tiny workloads, plus its workload helpers.

No speed is asserted anywhere: only that every backend ran the same workload and reported
well-formed, positive numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.bench.common.workload import (
    random_workload,
    sampleable_token_ids,
    shaped_warmup,
    shared_prefix_workload,
)
from cluster.cli.main import main

TINY = ["--num-prompts", "6", "--input-len-range", "4", "12", "--output-len-range", "2", "6"]
METRICS = ("elapsed_s", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s")


def _bench(tmp_path: Path, *argv: str) -> dict:
    out = tmp_path / "result.json"
    assert main(["bench", "throughput", *argv, "--result-json", str(out)]) == 0
    return json.loads(out.read_text())


def test_compare_runs_every_backend_on_one_workload(tmp_path: Path) -> None:
    result = _bench(tmp_path, "--compare", "--seed", "3", *TINY)
    workload = result["workload"]
    assert workload["name"] == "default" and workload["num_prompts"] == 6
    assert result["skipped"] == {}
    by_name = {r["backend"]: r for r in result["results"]}
    # kvray without prefix caching too: on a 0%-hit workload it prices the cache's bookkeeping.
    assert list(by_name) == ["kvray", "kvray-no-prefix-caching", "hf", "hf-cb"]
    for name, r in by_name.items():
        assert r["num_requests"] == 6, name
        assert r["prompt_tokens"] == workload["prompt_tokens"], name
        # ignore_eos everywhere: each backend produced exactly the requested tokens.
        assert r["output_tokens"] == workload["output_tokens"], name
        assert all(r[m] > 0 for m in METRICS), name
        assert not any("WARNING" in note for note in r["notes"]), name
    assert set(result["ratios"]) == {"kvray/hf", "kvray/hf-cb", "kvray/kvray-no-prefix-caching"}
    for ratio in result["ratios"].values():
        assert set(ratio) == {"requests_per_s", "output_tokens_per_s", "total_tokens_per_s"}
        assert all(v > 0 for v in ratio.values())
    # Roofline: the machine's matmul peak measured in the same run, each backend's share of it.
    roof = result["roofline"]
    assert roof["matmul_peak_flops_per_s"] > 0 and roof["torch_threads"] >= 1
    assert (
        roof["workload_flops"] == roof["workload_linear_flops"] + roof["workload_attention_flops"]
    )
    for name, r in by_name.items():
        assert r["achieved_flops_per_s"] > 0 and r["share_of_matmul_peak"] > 0, name
    assert by_name["kvray"]["compiled"] is False  # off on CPU unless --compile
    # vLLM-compatible summary of the first backend.
    assert result["num_requests"] == 6
    assert result["total_num_tokens"] == workload["prompt_tokens"] + workload["output_tokens"]
    assert result["requests_per_second"] == by_name["kvray"]["requests_per_s"]


def test_shared_prefix_reports_prefill_saved_by_prefix_cache(tmp_path: Path) -> None:
    # A small token budget admits about one prompt per step, so later prompts find the
    # shared prefix already computed (a request cannot hit blocks computed in its own step).
    result = _bench(
        tmp_path,
        "--compare",
        "--workload=shared-prefix",
        "--num-prompts=4",
        "--prefix-len=48",
        "--suffix-len=4",
        "--output-len=3",
        "--max-num-batched-tokens=64",
    )
    assert result["workload"]["prompt_tokens"] == 4 * 52
    by_name = {r["backend"]: r for r in result["results"]}
    assert list(by_name) == ["kvray", "kvray-no-prefix-caching", "hf", "hf-cb"]
    on, off = by_name["kvray"], by_name["kvray-no-prefix-caching"]
    assert on["prefix_caching"] is True and off["prefix_caching"] is False
    assert off["cached_prompt_tokens"] == 0 and off["prefill_tokens_computed"] == 4 * 52
    assert 0 < on["cached_prompt_tokens"] <= 3 * 48
    assert on["prefill_tokens_computed"] == 4 * 52 - on["cached_prompt_tokens"]
    assert on["prefix_cache_hits"] == on["cached_prompt_tokens"]
    assert "kvray/kvray-no-prefix-caching" in result["ratios"]


def test_workloads_are_seeded_and_in_range(demo_dir: Path) -> None:
    ids = sampleable_token_ids(demo_dir)
    special = {
        t["id"] for t in json.loads((demo_dir / "tokenizer.json").read_text())["added_tokens"]
    }
    assert special and not special & set(ids)
    kwargs = dict(num_prompts=50, input_len_range=(3, 9), output_len_range=(1, 4))
    a = random_workload(ids, seed=1, **kwargs)
    assert a == random_workload(ids, seed=1, **kwargs)
    assert a != random_workload(ids, seed=2, **kwargs)
    assert {r.prompt_len for r in a.requests} <= set(range(3, 10))
    assert {r.output_len for r in a.requests} <= {1, 2, 3, 4}
    assert len({r.prompt_len for r in a.requests}) > 1  # lengths really vary
    assert all(set(r.prompt_ids) <= set(ids) for r in a.requests)
    with pytest.raises(ValueError, match="--input-len-range"):
        random_workload(ids, seed=0, num_prompts=1, input_len_range=(5, 4), output_len_range=(1, 1))

    shared = shared_prefix_workload(
        ids, num_prompts=5, prefix_len=10, suffix_len=3, output_len=2, seed=0
    )
    prefixes = {r.prompt_ids[:10] for r in shared.requests}
    assert len(prefixes) == 1 and len({r.prompt_ids for r in shared.requests}) == 5
    assert shared.prompt_tokens == 5 * 13 and shared.output_tokens == 10

    # The warm-up has the workload's shape (count, prompt lengths) with other tokens and short
    # outputs: the timed run's step sizes are not new to the backend, its prompts are.
    a = random_workload(
        ids, seed=1, num_prompts=50, input_len_range=(3, 9), output_len_range=(5, 12)
    )
    warm = shaped_warmup(ids, a, seed=1, max_output=6)
    assert [q.prompt_len for q in warm.requests] == [q.prompt_len for q in a.requests]
    assert [q.output_len for q in warm.requests] == [min(q.output_len, 6) for q in a.requests]
    assert not {q.prompt_ids for q in warm.requests} & {q.prompt_ids for q in a.requests}
    assert all(set(q.prompt_ids) <= set(ids) for q in warm.requests)
    assert warm == shaped_warmup(ids, a, seed=1, max_output=6)


def test_compile_flag_runs_kvray_both_ways_side_by_side() -> None:
    import argparse

    from cluster.bench.throughput.main import _plan, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    plan = _plan(parser.parse_args(["--compare", "--compile"]))
    assert plan == ["kvray", "kvray-eager", "hf", "hf-cb"]
    assert _plan(parser.parse_args(["--compare", "--no-compile"]))[1] == "kvray-compiled"
    assert parser.parse_args([]).compile is None  # the engine's default
    # The overlap's win: the synchronous engine beside the async one.
    assert _plan(parser.parse_args(["--compare", "--async-scheduling"])) == [
        "kvray", "kvray-no-prefix-caching", "kvray-sync", "hf", "hf-cb"
    ]  # fmt: skip


def test_the_attention_backend_and_async_scheduling_reach_the_engine_only_when_chosen() -> None:
    import argparse

    from cluster.bench.throughput.kvray import llm_kwargs
    from cluster.bench.throughput.main import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert "attention_backend" not in llm_kwargs(parser.parse_args([]), "m", 1, True)
    args = parser.parse_args(["--attention-backend", "triton"])
    assert llm_kwargs(args, "m", 1, True)["attention_backend"] == "triton"
    assert "async_scheduling" not in llm_kwargs(args, "m", 1, True)
    args = parser.parse_args(["--async-scheduling"])
    assert llm_kwargs(args, "m", 1, True)["async_scheduling"] is True


def test_an_fp8_kv_cache_runs_beside_the_model_dtype_one(tmp_path: Path) -> None:
    """With --compare, the FP8 cache's run and the model-dtype one side by side: the same
    tokens (ignore_eos), and four times the blocks in the same memory (float32 on CPU)."""
    result = _bench(
        tmp_path, "--compare", "--kv-cache-dtype", "fp8", "--kv-cache-memory", "8MiB", *TINY
    )
    by_name = {r["backend"]: r for r in result["results"]}
    assert list(by_name) == ["kvray", "kvray-no-prefix-caching", "kvray-kv-auto", "hf", "hf-cb"]
    fp8, auto = by_name["kvray"], by_name["kvray-kv-auto"]
    assert (fp8["kv_cache_dtype"], auto["kv_cache_dtype"]) == ("float8_e4m3fn", "float32")
    assert fp8["kv_cache_blocks"] == 4 * auto["kv_cache_blocks"]
    assert fp8["output_tokens"] == auto["output_tokens"] == result["workload"]["output_tokens"]
    assert "kvray/kvray-kv-auto" in result["ratios"]


def test_a_failing_kvray_backend_is_reported_and_the_peers_still_run(tmp_path: Path) -> None:
    # max_num_seqs 0 is refused by the engine (and by hf-cb): the run goes on with hf, says
    # which backends failed and why, and exits 1.
    out = tmp_path / "result.json"
    argv = ["bench", "throughput", "--compare", "--max-num-seqs", "0", *TINY]
    assert main([*argv, "--result-json", str(out)]) == 1
    result = json.loads(out.read_text())
    assert [r["backend"] for r in result["results"]] == ["hf"]
    for name in ("kvray", "kvray-no-prefix-caching"):
        assert result["skipped"][name].startswith("FAILED: ValueError: max_num_seqs"), name
    assert not result["skipped"]["hf-cb"].startswith("FAILED")  # a peer that cannot run


def test_a_model_that_is_not_a_checkpoint_is_named(tmp_path: Path) -> None:
    for model in (tmp_path / "missing", tmp_path):  # no such directory; no config.json in it
        with pytest.raises(SystemExit, match="not a checkpoint directory"):
            main(["bench", "throughput", "--model", str(model), *TINY])

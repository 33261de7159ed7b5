"""`kvray bench throughput --workload json-schema`: the cost of constrained decoding.

The same prompts run three ways on one engine (greedy, prefix caching off so no run reuses
another's prompt blocks):

1. constrained: every request has one of a few JSON schemas (`SCHEMAS`), its grammars
   already compiled (a warm-up request per schema fills the compile cache first);
2. unconstrained: the same prompts, each with max_tokens = what its constrained twin
   generated and ignore_eos, so both runs generate exactly the same number of tokens;
3. mixed: every other request constrained, in one batch.

Each is timed REPEATS times, interleaved, keeping the best. Reported: output tok/s of each
and the ratios against unconstrained (the issue's goal: constrained >= 0.9 once grammars are
cached), plus grammar compile time cold (a compile) and cached (a cache hit and a matcher
copy) per schema.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from cluster.bench.common.result import write_result_json
from cluster.bench.common.workload import random_workload, sampleable_token_ids
from cluster.bench.throughput.kvray import llm_kwargs

# Bounded strings and arrays: a weak model finishes each object within MAX_TOKENS.
SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "maxLength": 16},
        },
        "required": ["name", "age", "email"],
        "additionalProperties": False,
    },
    "product": {
        "type": "object",
        "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "price": {"type": "number", "minimum": 0, "maximum": 1000},
            "category": {"enum": ["book", "toy", "food", "tool"]},
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 6},
                "minItems": 1,
                "maxItems": 3,
            },
        },
        "required": ["sku", "price", "category", "tags"],
        "additionalProperties": False,
    },
    "address": {
        "type": "object",
        "properties": {
            "street": {"type": "string", "maxLength": 14},
            "city": {"type": "string", "maxLength": 10},
            "geo": {
                "type": "object",
                "properties": {
                    "lat": {"type": "number", "minimum": -90, "maximum": 90},
                    "lon": {"type": "number", "minimum": -180, "maximum": 180},
                },
                "required": ["lat", "lon"],
                "additionalProperties": False,
            },
        },
        "required": ["street", "city", "geo"],
        "additionalProperties": False,
    },
    "tool_call": {
        "type": "object",
        "properties": {
            "name": {"enum": ["get_weather", "search", "send_email"]},
            "arguments": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "maxLength": 20},
                    "limit": {"type": "integer", "minimum": 1, "maximum": 10},
                },
                "required": ["query", "limit"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    },
}
MAX_TOKENS = 160
REPEATS = 3


def run_json_schema(args: argparse.Namespace, model_dir: Path, device: str) -> int:
    from workers import LLM, SamplingParams
    from workers.structured import StructuredOutputs

    token_ids = sampleable_token_ids(model_dir)
    workload = random_workload(
        token_ids,
        num_prompts=args.num_prompts or 64,
        input_len_range=tuple(args.input_len_range),
        output_len_range=(1, 1),  # unused: output lengths come from the constrained run
        seed=args.seed,
    )
    prompts = [list(r.prompt_ids) for r in workload.requests]
    names = list(SCHEMAS)
    specs = {n: StructuredOutputs.from_schema(s) for n, s in SCHEMAS.items()}
    print(
        f"kvray bench throughput: {model_dir} on {device}, workload json-schema: "
        f"{len(prompts)} requests over {len(names)} schemas ({', '.join(names)})"
    )
    llm = LLM(**llm_kwargs(args, model_dir, args.tensor_parallel_size, prefix_caching=False))
    try:
        compile_ms = _compile_times(llm, specs)

        def constrained(i: int) -> Any:
            spec = specs[names[i % len(names)]]
            return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_outputs=spec)

        # Warm-up: the model path, and one request per schema so every grammar is cached.
        llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
        llm.generate(
            prompts[: len(names)], [constrained(i) for i in range(len(names))], use_tqdm=False
        )

        # An untimed constrained pass gives each request's output length.
        c_params = [constrained(i) for i in range(len(prompts))]
        outs = llm.generate(prompts, c_params, use_tqdm=False)
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        finished = sum(o.outputs[0].finish_reason == "stop" for o in outs)

        def plain(i: int) -> Any:
            return SamplingParams(max_tokens=lengths[i], temperature=0.0, ignore_eos=True)

        runs = {
            "unconstrained": [plain(i) for i in range(len(prompts))],
            "constrained": c_params,
            "mixed": [c_params[i] if i % 2 == 0 else plain(i) for i in range(len(prompts))],
        }
        # Interleaved repeats, best of each: a busy host slows one run, not one kind of run.
        results: dict[str, dict[str, float]] = {}
        for _ in range(REPEATS):
            for name, params in runs.items():
                r = _timed(llm, prompts, params)[1]
                if name not in results or r["seconds"] < results[name]["seconds"]:
                    results[name] = r
        stats = llm.stats()
    finally:
        llm.engine.shutdown()

    base = results["unconstrained"]["output_tok_s"]
    print()
    print(
        f"{'run':<14}{'requests':>9}{'out tokens':>12}{'seconds':>10}{'out tok/s':>12}{'ratio':>8}"
    )
    for name, r in results.items():
        ratio = r["output_tok_s"] / base if base else float("nan")
        r["ratio_vs_unconstrained"] = ratio
        print(
            f"{name:<14}{len(prompts):>9}{int(r['output_tokens']):>12}{r['seconds']:>10.2f}"
            f"{r['output_tok_s']:>12.1f}{ratio:>8.3f}"
        )
    print(f"\nconstrained outputs finished by their grammar: {finished}/{len(prompts)}")
    print("grammar compile (ms): schema, cold compile, cached (hit + matcher copy)")
    for name, (cold, cached) in compile_ms.items():
        print(f"  {name:<12}{cold:>10.3f}{cached:>10.4f}")
    print(
        f"engine: {stats.structured_requests} structured requests, "
        f"{stats.grammar_cache_hits} compile-cache hits, {stats.grammar_compiles} compiles "
        f"({stats.grammar_compile_seconds * 1e3:.1f} ms in all)"
    )
    if args.result_json:
        write_result_json(
            args.result_json,
            {
                "model": str(model_dir),
                "device": device,
                "workload": "json-schema",
                "num_requests": len(prompts),
                "results": results,
                "constrained_finished": finished,
                "compile_ms": {n: {"cold": c, "cached": h} for n, (c, h) in compile_ms.items()},
            },
        )
        print(f"\nwrote {args.result_json}")
    return 0


def _timed(llm: Any, prompts: list[list[int]], params: list[Any]) -> tuple[list[Any], dict]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return outs, {"seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds}


def _compile_times(llm: Any, specs: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Per schema: a cold compile and a cached lookup, in ms, on a compiler of their own (the
    engine's cache stays as the runs find it). The tokenizer is built first, outside both."""
    from workers.structured import StructuredOutputs
    from workers.structured.compiler import GrammarCompiler

    engine = llm.engine
    compiler = GrammarCompiler(
        engine.tokenizer.hf, engine.vocab_size, engine.eos_token_ids, cache_size=64
    )
    try:
        compiler.get(StructuredOutputs(regex="warm")).result()  # builds the tokenizer
        out = {}
        for name, spec in specs.items():
            t0 = time.perf_counter()
            compiler.get(spec).result()
            cold = time.perf_counter() - t0
            hits = []
            for _ in range(20):
                t0 = time.perf_counter()
                compiler.get(spec).result().matcher()
                hits.append(time.perf_counter() - t0)
            out[name] = (cold * 1e3, statistics.median(hits) * 1e3)
        return out
    finally:
        compiler.shutdown()

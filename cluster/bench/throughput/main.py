"""`kvray bench throughput`: offline throughput of kvray against transformers, same workload.

Backends (all greedy, every request ignore_eos with max_tokens = its output length):
- kvray: `workers.LLM(...).generate(all prompts)`: continuous batching over a paged KV cache.
- hf:    transformers `generate` on static left-padded batches, filled in request order up to
         --hf-max-batch-size, each run to its longest output (vLLM's `run_hf` rule). Tokens a
         request generates past its own length are wasted work and not counted.
- hf-cb: transformers' own continuous batching (`init_continuous_batching`), one request per
         prompt with its own max_new_tokens.

Each backend is loaded, warmed up on a few separate short requests through the same code path,
then timed over the whole workload. --compare runs all of them in one command and prints the
ratios, which is the number this command exists for (never a timing assertion in tests).

This module runs the command; the backends are throughput/kvray.py and throughput/hf.py, and
what each is handed (Run) is in throughput/run.py.
"""

from __future__ import annotations

import argparse
import gc
import os
import traceback
from pathlib import Path
from typing import Any

from cluster.bench.common import roofline
from cluster.bench.common.model_arg import add_model_argument
from cluster.bench.common.result import BenchResult, format_table, ratios, write_result_json
from cluster.bench.common.workload import (
    Workload,
    random_workload,
    sampleable_token_ids,
    shaped_warmup,
    shared_prefix_workload,
)
from cluster.bench.throughput.hf import run_hf, run_hf_cb
from cluster.bench.throughput.kvray import run_kvray
from cluster.bench.throughput.run import Run
from cluster.config.units import parse_size
from workers.cache_config import KV_CACHE_DTYPES
from workers.config import ATTENTION_BACKENDS, DEFAULT_MAX_NUM_SEQS

BACKENDS = ("kvray", "hf", "hf-cb")
NO_PREFIX = "kvray-no-prefix-caching"
TP1 = "kvray-tp1"
COMPILED = "kvray-compiled"
EAGER = "kvray-eager"
SYNC = "kvray-sync"  # with --async-scheduling: the synchronous engine beside it
KV_AUTO = "kvray-kv-auto"  # with --kv-cache-dtype fp8: the model-dtype KV cache beside it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    add_model_argument(parser)
    a("--backend", choices=BACKENDS, default="kvray", help="backend to time (default: kvray)")
    a("--compare", action="store_true", help="run every backend on the same workload; print ratios")
    a(
        "--workload",
        choices=("default", "shared-prefix", "json-schema"),
        default="default",
        help="json-schema: constrained vs unconstrained decoding of the same prompts (kvray)",
    )
    a("--num-prompts", type=int, default=None, help="default 256 (shared-prefix: 64)")
    a("--input-len-range", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    a("--output-len-range", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    a("--prefix-len", type=int, default=512, help="shared-prefix: common prefix tokens")
    a("--suffix-len", type=int, default=32, help="shared-prefix: unique tokens per prompt")
    a("--output-len", type=int, default=32, help="shared-prefix: output tokens per request")
    a("--seed", type=int, default=0)
    a("--hf-max-batch-size", type=int, default=8, help="hf backend: static batch size")
    a("--tensor-parallel-size", type=int, default=1)
    a("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS)
    a("--max-num-batched-tokens", type=int, default=None)
    a("--kv-cache-memory", type=parse_size, default=None, help="KV cache size, e.g. 2GiB")
    a("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    a("--device", default=None, help="cpu | cuda (default: cuda if available)")
    a("--no-prefix-caching", action="store_true", help="kvray: disable prefix caching")
    a(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="kvray: torch.compile the model forward (default: the engine's, off on CPU); "
        "with --compare, kvray also runs with the opposite setting, side by side",
    )
    a(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="kvray: the attention backend (default auto: the engine's choice)",
    )
    a(
        "--async-scheduling",
        action="store_true",
        help="kvray: schedule each step while the last one runs (tensor-parallel size 1); "
        "with --compare, kvray also runs synchronously, side by side",
    )
    a(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="kvray: the KV cache's element type (fp8: float8 e4m3); with --compare and fp8, "
        "kvray also runs with the model's dtype, side by side (the KV blocks each holds in "
        "--kv-cache-memory are reported)",
    )
    a(
        "--speculative-config",
        default=None,
        help='kvray: speculative decoding, vLLM\'s JSON (e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4}\'); `kvray bench spec-decode` compares it to off',
    )
    a("--result-json", default=None, metavar="FILE", help="write the results as JSON")


def run(args: argparse.Namespace) -> int:
    if args.model and args.model.startswith("random:"):
        from cluster.bench.common.random_model import random_model_dir

        # Stored in bfloat16 on every device, as the real checkpoints of these shapes are; on
        # CPU every backend computes in float32 all the same (--dtype auto).
        model_dir = random_model_dir(args.model.split(":", 1)[1], dtype="bfloat16")
    else:
        model_dir = Path(args.model) if args.model else _demo_dir()
        if not (model_dir / "config.json").is_file():
            raise SystemExit(f"--model {args.model}: not a checkpoint directory (no config.json)")
    if args.workload == "json-schema":
        from cluster.bench.throughput.structured import run_json_schema

        return run_json_schema(args, model_dir, args.device or _default_device())
    token_ids = sampleable_token_ids(model_dir)
    workload = _workload(args, token_ids)
    device = args.device or _default_device()
    r = Run(args, model_dir, device, workload, shaped_warmup(token_ids, workload, seed=args.seed))
    print(
        f"kvray bench throughput: {model_dir} on {device}, workload {workload.name}: "
        f"{len(workload.requests)} requests, {workload.prompt_tokens} prompt + "
        f"{workload.output_tokens} output tokens"
    )

    load_note = _load_warning()
    if load_note:
        print(load_note)
    peak = _matmul_peak(args, device)
    if peak is not None:
        print(f"{peak.describe()}")
    plan = _plan(args)
    results: list[BenchResult] = []
    skipped: dict[str, str] = {}
    for name in plan:
        result = _run_backend(name, r, skipped)
        if result is not None:
            results.append(result)
            print(result.line())
            for note in result.notes:
                print(f"{'':>32}{note}")

    by_name = {res.backend: res for res in results}
    comparisons = _comparisons(by_name) if args.compare else {}
    print()
    print(format_table(results, skipped, comparisons))
    amx_peak = _amx_peak(results, peak)
    roof_lines, roof = roofline.report(
        results,
        roofline.workload_flops(roofline.ModelShape.from_dir(model_dir), workload),
        peak,
        amx_peak,
    )
    print()
    print("\n".join(roof_lines))
    if args.result_json:
        payload = _payload(r, results, skipped, comparisons)
        payload["roofline"] = roof
        write_result_json(args.result_json, payload)
        print(f"\nwrote {args.result_json}")
    # A backend that did not run is a failure, except hf-cb, a peer that may not run here.
    failed = [name for name in plan if name in skipped and name != "hf-cb"]
    return 0 if results and not failed else 1


def _plan(args: argparse.Namespace) -> list[str]:
    if not args.compare:
        return [NO_PREFIX if args.backend == "kvray" and args.no_prefix_caching else args.backend]
    plan = _compare_plan(args)
    if getattr(args, "async_scheduling", False):  # the overlap's win, side by side
        plan.insert(plan.index("hf"), SYNC)
    if getattr(args, "kv_cache_dtype", "auto") == "fp8":  # the FP8 cache's room and cost
        plan.insert(plan.index("hf"), KV_AUTO)
    return plan


def _compare_plan(args: argparse.Namespace) -> list[str]:
    if args.compile is not None:  # the compiled forward's win, measured side by side
        return ["kvray", EAGER if args.compile else COMPILED, "hf", "hf-cb"]
    if args.workload == "shared-prefix":
        return ["kvray", NO_PREFIX, "hf", "hf-cb"]
    if args.tensor_parallel_size > 1:
        return ["kvray", TP1, "hf", "hf-cb"]
    # kvray without prefix caching on a 0%-hit workload: the cost of the cache's bookkeeping.
    return ["kvray", NO_PREFIX, "hf", "hf-cb"]


def _workload(args: argparse.Namespace, token_ids: list[int]) -> Workload:
    if args.workload == "shared-prefix":
        return shared_prefix_workload(
            token_ids,
            num_prompts=args.num_prompts or 64,
            prefix_len=args.prefix_len,
            suffix_len=args.suffix_len,
            output_len=args.output_len,
            seed=args.seed,
        )
    return random_workload(
        token_ids,
        num_prompts=args.num_prompts or 256,
        input_len_range=tuple(args.input_len_range),
        output_len_range=tuple(args.output_len_range),
        seed=args.seed,
    )


def _comparisons(by_name: dict[str, BenchResult]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    kv = by_name.get("kvray")
    for other in ("hf", "hf-cb", NO_PREFIX, TP1, COMPILED, EAGER, SYNC, KV_AUTO):
        if kv is not None and other in by_name:
            out[f"kvray/{other}"] = ratios(kv, by_name[other])
    return out


def _payload(
    r: Run,
    results: list[BenchResult],
    skipped: dict[str, str],
    comparisons: dict[str, dict[str, float]],
) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": str(r.model_dir),
        "device": r.device,
        "workload": r.workload.describe(),
        "results": [res.to_dict() for res in results],
        "skipped": skipped,
        "ratios": comparisons,
        "load_average_1m": os.getloadavg()[0],
        "cpu_count": os.cpu_count(),
    }
    if results:
        # vLLM's `bench throughput` keys, for the first backend run, so its tooling reads ours.
        first = results[0]
        payload.update(
            elapsed_time=first.elapsed_s,
            num_requests=first.num_requests,
            total_num_tokens=first.prompt_tokens + first.output_tokens,
            requests_per_second=first.requests_per_s,
            tokens_per_second=first.total_tokens_per_s,
        )
    return payload


def _run_backend(name: str, r: Run, skipped: dict[str, str]) -> BenchResult | None:
    print(f"\n== {name}")
    try:
        if name == "kvray":
            return run_kvray(r, prefix_caching=True, name=name)
        if name == NO_PREFIX:
            return run_kvray(r, prefix_caching=False, name=name)
        if name == TP1:
            return run_kvray(r, prefix_caching=True, name=name, tensor_parallel_size=1)
        if name in (COMPILED, EAGER):
            return run_kvray(r, prefix_caching=True, name=name, compile=name == COMPILED)
        if name == SYNC:
            return run_kvray(r, prefix_caching=True, name=name, async_scheduling=False)
        if name == KV_AUTO:
            return run_kvray(r, prefix_caching=True, name=name, kv_cache_dtype="auto")
        if name == "hf":
            return run_hf(r)
        return run_hf_cb(r)
    except Exception as e:  # reported, not fatal to the other backends
        reason = f"{type(e).__name__}: {e}".splitlines()[0][:200]
        traceback.print_exc()
        if name == "hf-cb":  # a peer that cannot run here
            print(f"hf-cb (transformers continuous batching) cannot run here, skipping: {reason}")
            skipped[name] = reason
        else:  # a failure: the others still run, and the command exits 1
            print(f"{name} FAILED: {reason}")
            skipped[name] = f"FAILED: {reason}"
        return None
    finally:
        gc.collect()
        import torch

        if torch.cuda.is_available():  # hand the freed KV cache back before the next backend
            torch.cuda.empty_cache()


def _matmul_peak(args: argparse.Namespace, device: str) -> roofline.MatmulPeak | None:
    """This machine's matmul peak, measured now with the threads the backends will use."""
    dtype = args.dtype if args.dtype not in (None, "auto") else None
    if dtype is None:
        dtype = "float32" if device == "cpu" else "bfloat16"
    try:
        return roofline.measure_matmul_peak(device, dtype)
    except Exception as e:  # noqa: BLE001 - a missing figure must not cost the benchmark
        print(f"matmul peak not measured: {type(e).__name__}: {e}")
        return None


def _amx_peak(
    results: list[BenchResult], peak: roofline.MatmulPeak | None
) -> roofline.MatmulPeak | None:
    """The peak of the AMX GEMM, measured only when a backend's bfloat16 weights ran on it
    (a kvray engine on a CPU with AMX, in float32), in the same run as the float32 peak."""
    if peak is None or not any(res.extra.get("amx") for res in results):
        return None
    try:
        return roofline.measure_amx_peak()
    except Exception as e:  # noqa: BLE001 - as for the matmul peak
        print(f"AMX peak not measured: {type(e).__name__}: {e}")
        return None


def _load_warning() -> str | None:
    """A warning when other processes already keep the CPUs busy.

    Throughput on an oversubscribed host says little, and it skews comparisons: torch's OpenMP
    workers spin-wait between ops, and a descheduled spinner can make main-thread forward
    passes ~10x slower while a backend stepping on a background thread (hf-cb) barely
    suffers. OMP_WAIT_POLICY=PASSIVE (set before Python starts) removes most of that.
    """
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    if load <= cpus:
        return None
    return (
        f"WARNING: load average {load:.1f} on {cpus} CPUs: the host is busy, so timings are "
        "noisy; on CPU consider running with OMP_WAIT_POLICY=PASSIVE"
    )


def _demo_dir() -> Path:
    from workers.demo import demo_model_dir

    return demo_model_dir()


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"

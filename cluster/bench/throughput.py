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
"""

from __future__ import annotations

import argparse
import gc
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.bench.common import (
    BenchResult,
    Workload,
    format_table,
    parse_size,
    random_workload,
    ratios,
    sampleable_token_ids,
    shared_prefix_workload,
    warmup_workload,
    write_result_json,
)

BACKENDS = ("kvray", "hf", "hf-cb")
NO_PREFIX = "kvray-no-prefix-caching"
TP1 = "kvray-tp1"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a(
        "--model",
        default=None,
        help="HF checkpoint directory (default: the built-in demo model), or random:qwen3-100m / "
        "random:qwen3-0.6b for a seeded random-weight checkpoint of that shape",
    )
    a("--backend", choices=BACKENDS, default="kvray", help="backend to time (default: kvray)")
    a("--compare", action="store_true", help="run every backend on the same workload; print ratios")
    a("--workload", choices=("default", "shared-prefix"), default="default")
    a("--num-prompts", type=int, default=None, help="default 256 (shared-prefix: 64)")
    a("--input-len-range", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    a("--output-len-range", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    a("--prefix-len", type=int, default=512, help="shared-prefix: common prefix tokens")
    a("--suffix-len", type=int, default=32, help="shared-prefix: unique tokens per prompt")
    a("--output-len", type=int, default=32, help="shared-prefix: output tokens per request")
    a("--seed", type=int, default=0)
    a("--hf-max-batch-size", type=int, default=8, help="hf backend: static batch size")
    a("--tensor-parallel-size", type=int, default=1)
    a("--max-num-seqs", type=int, default=256)
    a("--max-num-batched-tokens", type=int, default=None)
    a("--kv-cache-memory", type=parse_size, default=None, help="KV cache size, e.g. 2GiB")
    a("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    a("--device", default=None, help="cpu | cuda (default: cuda if available)")
    a("--no-prefix-caching", action="store_true", help="kvray: disable prefix caching")
    a("--result-json", default=None, metavar="FILE", help="write the results as JSON")


@dataclass(frozen=True)
class _Run:
    """What every backend needs: the resolved inputs of this command."""

    args: argparse.Namespace
    model_dir: Path
    device: str
    workload: Workload
    warmup: Workload


def run(args: argparse.Namespace) -> int:
    if args.model and args.model.startswith("random:"):
        from cluster.bench.random_model import random_model_dir

        model_dir = random_model_dir(
            args.model.split(":", 1)[1],
            dtype="float32" if _default_device() == "cpu" else "bfloat16",
        )
    else:
        model_dir = Path(args.model) if args.model else _demo_dir()
    token_ids = sampleable_token_ids(model_dir)
    workload = _workload(args, token_ids)
    device = args.device or _default_device()
    r = _Run(args, model_dir, device, workload, warmup_workload(token_ids, seed=args.seed))
    print(
        f"kvray bench throughput: {model_dir} on {device}, workload {workload.name}: "
        f"{len(workload.requests)} requests, {workload.prompt_tokens} prompt + "
        f"{workload.output_tokens} output tokens"
    )

    load_note = _load_warning()
    if load_note:
        print(load_note)
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
    if args.result_json:
        write_result_json(args.result_json, _payload(r, results, skipped, comparisons))
        print(f"\nwrote {args.result_json}")
    return 0 if results else 1


def _plan(args: argparse.Namespace) -> list[str]:
    if not args.compare:
        return [NO_PREFIX if args.backend == "kvray" and args.no_prefix_caching else args.backend]
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
    for other in ("hf", "hf-cb", NO_PREFIX, TP1):
        if kv is not None and other in by_name:
            out[f"kvray/{other}"] = ratios(kv, by_name[other])
    return out


def _payload(
    r: _Run,
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


def _run_backend(name: str, r: _Run, skipped: dict[str, str]) -> BenchResult | None:
    print(f"\n== {name}")
    try:
        if name == "kvray":
            return _run_kvray(r, prefix_caching=True, name=name)
        if name == NO_PREFIX:
            return _run_kvray(r, prefix_caching=False, name=name)
        if name == TP1:
            return _run_kvray(r, prefix_caching=True, name=name, tensor_parallel_size=1)
        if name == "hf":
            return _run_hf(r)
        return _run_hf_cb(r)
    except Exception as e:  # a peer that cannot run here is reported, not fatal to the rest
        if name != "hf-cb":
            raise
        reason = f"{type(e).__name__}: {e}".splitlines()[0][:200]
        print(f"hf-cb (transformers continuous batching) cannot run here, skipping: {reason}")
        traceback.print_exc()
        skipped[name] = reason
        return None
    finally:
        gc.collect()


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


def _progress(total: int, desc: str, *, enabled: bool = True) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True, disable=not enabled)


# ---------------------------------------------------------------------------------- kvray


def _run_kvray(
    r: _Run, *, prefix_caching: bool, name: str, tensor_parallel_size: int | None = None
) -> BenchResult:
    from workers import LLM

    args = r.args
    tp = tensor_parallel_size or args.tensor_parallel_size
    kwargs: dict[str, Any] = dict(
        model=str(r.model_dir),
        tensor_parallel_size=tp,
        dtype=args.dtype,
        enable_prefix_caching=prefix_caching,
        kv_cache_memory_bytes=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=args.seed,
    )
    if args.device:
        kwargs["device"] = args.device
    llm = LLM(**kwargs)
    try:
        _kvray_generate(llm, r.warmup, progress=False)
        before = llm.stats()
        t_before = llm.engine.executor.timing()
        start = time.perf_counter()
        outputs = _kvray_generate(llm, r.workload, progress=True)
        elapsed = time.perf_counter() - start
        after = llm.stats()
        t_after = llm.engine.executor.timing()
    finally:
        llm.engine.shutdown()  # frees the KV cache (and TP workers) before the next backend
        del llm

    generated = [len(o.outputs[0].token_ids) for o in outputs]
    notes = _length_notes(r.workload, generated)
    cached = sum(o.num_cached_tokens for o in outputs)
    extra: dict[str, Any] = {
        "prefix_caching": prefix_caching,
        "cached_prompt_tokens": cached,
        "prefill_tokens_computed": r.workload.prompt_tokens - cached,
    }
    # Counters are cumulative: the difference is what the measured run did.
    for field in ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "num_steps"):
        extra[field] = getattr(after, field) - getattr(before, field)
    notes.append(
        f"prefill tokens computed: {extra['prefill_tokens_computed']} of "
        f"{r.workload.prompt_tokens} ({cached} from the prefix cache)"
    )
    notes.extend(_step_timing(extra, t_before, t_after, tp))
    return BenchResult(
        backend=name,
        elapsed_s=elapsed,
        num_requests=len(outputs),
        prompt_tokens=r.workload.prompt_tokens,
        output_tokens=sum(generated),
        notes=tuple(notes),
        extra=extra,
    )


def _step_timing(
    extra: dict[str, Any], before: dict[str, float], after: dict[str, float], tp: int
) -> list[str]:
    """Per-step time split: model step on rank 0, its collectives, and the actor-call overhead."""
    steps = max(1, after["steps"] - before["steps"])
    per = {k: (after[k] - before[k]) / steps * 1e3 for k in ("execute_s", "collective_s", "wall_s")}
    extra.update(
        tensor_parallel_size=tp,
        step_ms=per["wall_s"],
        rank0_execute_ms_per_step=per["execute_s"],
        all_reduce_ms_per_step=per["collective_s"],
        actor_call_overhead_ms_per_step=per["wall_s"] - per["execute_s"],
    )
    extra["load_peak_rss_mb_rank0"] = after["load_peak_rss_bytes"] / 2**20
    extra["load_anon_mb_rank0"] = after["load_anon_bytes"] / 2**20
    extra["param_mb_rank0"] = after["param_bytes"] / 2**20
    line = (
        f"TP={tp}: {per['wall_s']:.2f} ms/step; rank 0 holds {extra['param_mb_rank0']:.0f} MiB "
        f"of weights; loading added {extra['load_anon_mb_rank0']:.0f} MiB private memory "
        f"(peak RSS +{extra['load_peak_rss_mb_rank0']:.0f} MiB incl. mapped checkpoint pages)"
    )
    if tp > 1:
        line += (
            f" (rank 0 {per['execute_s']:.2f} ms of which all-reduce {per['collective_s']:.2f} ms;"
            f" actor calls add {per['wall_s'] - per['execute_s']:.2f} ms)"
        )
    return [line]


def _kvray_generate(llm: Any, workload: Workload, *, progress: bool) -> list[Any]:
    from workers import SamplingParams

    prompts = [list(req.prompt_ids) for req in workload.requests]
    params = [
        SamplingParams(max_tokens=req.output_len, ignore_eos=True, temperature=0.0)
        for req in workload.requests
    ]
    return llm.generate(prompts, params, use_tqdm=progress)


def _length_notes(workload: Workload, generated: list[int]) -> list[str]:
    wrong = sum(g != req.output_len for g, req in zip(generated, workload.requests, strict=True))
    if not wrong:
        return []
    return [f"WARNING: {wrong} requests did not produce exactly their output length"]


# ---------------------------------------------------------------------------------- transformers


def _hf_dtype(r: _Run) -> Any:
    import torch

    if r.args.dtype not in (None, "auto"):
        return getattr(torch, r.args.dtype)
    # float32 on CPU (the parity setting, and what CPUs run fastest without AMX); on GPUs the
    # checkpoint's own dtype.
    return torch.float32 if r.device == "cpu" else "auto"


def _load_hf(r: _Run, **kwargs: Any) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(r.model_dir), dtype=_hf_dtype(r), **kwargs)
    return model.to(r.device).eval()


def _never_eos(model: Any) -> int:
    """An EOS id outside the vocabulary: generation never stops early and no logit is masked."""
    return int(model.config.get_text_config().vocab_size)


def _pad_id(model: Any) -> int:
    pad = getattr(model.generation_config, "pad_token_id", None)
    if pad is None:
        pad = getattr(model.config.get_text_config(), "pad_token_id", None)
    return int(pad) if pad is not None else 0


def _hf_batches(workload: Workload, max_batch_size: int, max_len: int) -> list[list[Any]]:
    """Fill batches in request order up to max_batch_size, cutting early where the padded batch
    (longest prompt + longest output) would exceed the model's context."""
    batches: list[list[Any]] = []
    batch: list[Any] = []
    for req in workload.requests:
        if batch:
            longest_prompt = max(req.prompt_len, *(b.prompt_len for b in batch))
            longest_output = max(req.output_len, *(b.output_len for b in batch))
            if len(batch) >= max_batch_size or longest_prompt + longest_output > max_len:
                batches.append(batch)
                batch = []
        batch.append(req)
    if batch:
        batches.append(batch)
    return batches


def _hf_generate_batch(model: Any, batch: list[Any], device: str) -> None:
    import torch
    from transformers import GenerationConfig

    pad = _pad_id(model)
    width = max(req.prompt_len for req in batch)
    ids = [[pad] * (width - req.prompt_len) + list(req.prompt_ids) for req in batch]
    mask = [[0] * (width - req.prompt_len) + [1] * req.prompt_len for req in batch]
    config = GenerationConfig(
        max_new_tokens=max(req.output_len for req in batch),
        do_sample=False,
        eos_token_id=_never_eos(model),
        pad_token_id=pad,
    )
    with torch.no_grad():
        model.generate(
            torch.tensor(ids, device=device),
            attention_mask=torch.tensor(mask, device=device),
            generation_config=config,
        )


def _run_hf(r: _Run) -> BenchResult:
    model = _load_hf(r)
    max_len = int(getattr(model.config.get_text_config(), "max_position_embeddings", 1 << 30))
    if r.workload.max_seq_len > max_len:
        raise ValueError(f"workload needs {r.workload.max_seq_len} positions, model has {max_len}")
    size = r.args.hf_max_batch_size
    for batch in _hf_batches(r.warmup, size, max_len):
        _hf_generate_batch(model, batch, r.device)
    batches = _hf_batches(r.workload, size, max_len)
    _sync(r.device)
    start = time.perf_counter()
    with _progress(len(r.workload.requests), "hf") as bar:
        for batch in batches:
            _hf_generate_batch(model, batch, r.device)
            bar.update(len(batch))
    _sync(r.device)
    elapsed = time.perf_counter() - start
    del model
    return BenchResult(
        backend="hf",
        elapsed_s=elapsed,
        num_requests=len(r.workload.requests),
        prompt_tokens=r.workload.prompt_tokens,
        # Requested lengths, like vLLM: padding rows run to the batch's longest output.
        output_tokens=r.workload.output_tokens,
        notes=(f"{len(batches)} static batches of up to {size}",),
        extra={"hf_max_batch_size": size, "num_batches": len(batches)},
    )


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _run_hf_cb(r: _Run) -> BenchResult:
    import logging

    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    # sdpa works on CPU and GPU alike; on a GPU with flash-attn installed transformers would
    # switch to it by itself, which we allow there (it is what a user of hf-cb would get).
    model = _load_hf(r, attn_implementation="sdpa")
    both = r.workload.requests + r.warmup.requests
    page = 64
    cb_config = ContinuousBatchingConfig(
        page_size=page,
        # Room for every request at once: hf-cb should not be the one short of KV memory.
        num_blocks=sum(-(-(q.prompt_len + q.output_len) // page) for q in both) + 1,
        max_batch_tokens=r.args.max_num_batched_tokens or 2048,
        max_requests_per_batch=r.args.max_num_seqs,
        auto_switch_to_flash=r.device != "cpu",
        use_cuda_graph=False if r.device == "cpu" else None,
    )
    hints = WorkloadHints(
        max_prompt_length=max(q.prompt_len for q in both),
        max_generated_length=max(q.output_len for q in both),
        num_requests=len(r.workload.requests),
    )
    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=_pad_id(model))
    # Without psutil, transformers logs an ERROR on CPU about memory sizing that does not apply:
    # we size the cache ourselves (num_blocks). Drop just that message while hf-cb runs.
    cb_logger = logging.getLogger("ContinuousBatchingLogger")
    nag = _DropPsutilNag()
    cb_logger.addFilter(nag)
    try:
        with model.continuous_batching_context_manager(
            generation_config=gen_config,
            continuous_batching_config=cb_config,
            workload_hints=hints,
            block=True,
            timeout=30,
            warmup=True,
        ) as manager:
            _hf_cb_generate(manager, r.warmup, progress=False)
            _sync(r.device)
            start = time.perf_counter()
            generated = _hf_cb_generate(manager, r.workload, progress=True)
            _sync(r.device)
            elapsed = time.perf_counter() - start
    finally:
        cb_logger.removeFilter(nag)
    del model
    return BenchResult(
        backend="hf-cb",
        elapsed_s=elapsed,
        num_requests=len(r.workload.requests),
        prompt_tokens=r.workload.prompt_tokens,
        output_tokens=sum(generated),
        notes=tuple(_length_notes(r.workload, generated)),
        extra={"page_size": page},
    )


class _DropPsutilNag:
    """logging filter: drops transformers' 'install psutil' messages, keeps everything else."""

    def filter(self, record: Any) -> bool:
        return "psutil" not in record.getMessage()


def _hf_cb_generate(manager: Any, workload: Workload, *, progress: bool) -> list[int]:
    """Submit every request with its own max_new_tokens; return generated lengths in order."""
    ids = [
        manager.add_request(list(req.prompt_ids), max_new_tokens=req.output_len, eos_token_id=-1)
        for req in workload.requests
    ]
    if any(i is None for i in ids):
        raise RuntimeError("continuous batching manager refused requests")
    done: dict[str, int] = {}
    with _progress(len(ids), "hf-cb", enabled=progress) as bar:
        while len(done) < len(ids):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' generation thread stopped")
                continue
            if result.error is not None:
                raise RuntimeError(f"request {result.request_id} failed: {result.error}")
            if result.is_finished():
                done[result.request_id] = len(result.generated_tokens)
                bar.update(1)
    return [done[i] for i in ids]

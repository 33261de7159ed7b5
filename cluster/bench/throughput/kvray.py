"""The kvray backend of `kvray bench throughput`: `workers.LLM(...).generate(all prompts)`,
plus what the engine's own counters say about the measured run (prefix cache, step timing)."""

from __future__ import annotations

import time
from typing import Any

from cluster.bench.common.result import BenchResult
from cluster.bench.common.workload import Workload
from cluster.bench.throughput.run import Run, length_notes


def run_kvray(
    r: Run,
    *,
    prefix_caching: bool,
    name: str,
    tensor_parallel_size: int | None = None,
    compile: bool | None = None,
    async_scheduling: bool | None = None,
    kv_cache_dtype: str | None = None,
) -> BenchResult:
    """`compile`: None = the command's --compile/--no-compile (or the engine's default);
    `async_scheduling`, `kv_cache_dtype`: None = the command's flag."""
    import torch

    from workers import LLM

    tp = tensor_parallel_size or r.args.tensor_parallel_size
    kwargs = llm_kwargs(r.args, r.model_dir, tp, prefix_caching)
    if compile is not None:
        kwargs["compile"] = compile
    if async_scheduling is not None:
        kwargs["async_scheduling"] = async_scheduling
    if kv_cache_dtype is not None:
        kwargs["kv_cache_dtype"] = kv_cache_dtype
    t_load = time.perf_counter()
    llm = LLM(**kwargs)
    startup_s = time.perf_counter() - t_load
    try:
        _kvray_generate(llm, r.warmup, progress=False)
        before = llm.stats()
        t_before = llm.engine.executor.timing()
        start = time.perf_counter()
        outputs = _kvray_generate(llm, r.workload, progress=True)
        elapsed = time.perf_counter() - start
        after = llm.stats()
        t_after = llm.engine.executor.timing()
        on_amx = _on_amx(llm)
        kv_blocks = llm.engine.block_manager.num_blocks
        block_size = llm.engine.config.cache.block_size
        kv_dtype = llm.engine.config.kv_dtype_name
    finally:
        llm.engine.shutdown()  # frees the KV cache (and TP workers) before the next backend
        del llm

    generated = [len(o.outputs[0].token_ids) for o in outputs]
    notes = length_notes(r.workload, generated)
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
    extra.update(kv_cache_dtype=kv_dtype, kv_cache_blocks=kv_blocks)
    notes.append(f"KV cache: {kv_blocks} blocks ({kv_blocks * block_size} tokens) of {kv_dtype}")
    compiled = t_after.get("compile_s")
    extra.update(
        startup_s=startup_s,
        torch_threads=torch.get_num_threads(),
        compiled=compiled is not None,
        amx=on_amx,
    )
    line = f"start-up {startup_s:.1f} s; {extra['torch_threads']} torch threads; "
    if compiled is None:
        line += "eager forward"
    else:
        extra["compile_s"] = compiled
        line += f"compiled forward ({compiled:.1f} s of the start-up compiling)"
    if on_amx:
        line += "; bfloat16 weights on the AMX tiles (float32-accurate)"
    notes.append(line)
    return BenchResult(
        backend=name,
        elapsed_s=elapsed,
        num_requests=len(outputs),
        prompt_tokens=r.workload.prompt_tokens,
        output_tokens=sum(generated),
        notes=tuple(notes),
        extra=extra,
    )


def _on_amx(llm: Any) -> bool:
    """Whether the engine's linear layers run on AMX (csrc/amx_linear.c): a bfloat16
    checkpoint in float32 on a CPU with AMX. Known for the in-process worker (TP = 1)."""
    from workers.device.layers.cpu_kernels import on_amx_tiles

    worker = getattr(llm.engine.executor, "worker", None)
    return worker is not None and on_amx_tiles(worker.model)


def llm_kwargs(args: Any, model_dir: Any, tp: int, prefix_caching: bool) -> dict[str, Any]:
    """The offline LLM's keyword arguments from `kvray bench throughput`'s flags."""
    kwargs: dict[str, Any] = dict(
        model=str(model_dir),
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
    if getattr(args, "compile", None) is not None:
        kwargs["compile"] = args.compile
    if getattr(args, "attention_backend", "auto") != "auto":
        kwargs["attention_backend"] = args.attention_backend
    if getattr(args, "async_scheduling", False):
        kwargs["async_scheduling"] = True
    if getattr(args, "kv_cache_dtype", "auto") != "auto":
        kwargs["kv_cache_dtype"] = args.kv_cache_dtype
    if getattr(args, "speculative_config", None):
        kwargs["speculative_config"] = args.speculative_config
    return kwargs


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

"""`kvray bench step`: one engine step in isolation, so a device's work can be judged step by
step.

On an offline engine (`LLMEngine`, the worker in process) it measures:
- decode steps: for each --batch-sizes B, B requests with prompts of --context random tokens
  are stepped until every one is decoding, then --warmup steps, then --steps timed steps,
  each of B tokens and nothing else;
- a prefill step: one request of --prefill-tokens tokens (capped below max_model_len), in one
  chunk (the step's token budget is at least that), after one warm-up of the same size.
For each case: the wall time of `LLMEngine.step()`, of `Worker.execute`, and of the forward and
sampling (CUDA events on CUDA); the ops of one step (CPU: torch ops dispatched, counted with a
TorchDispatchMode; CUDA: kernels, with torch.profiler), also per layer; and the bytes the step
reads at least (weights, K/V attended) over its device time, against the device's copy
bandwidth (step/report.py).

The timings, ops and bytes come from outside the engine (step/probes.py): the worker's own
attributes (`execute`, `_execute`, `forward`) are wrapped, the engine is not changed.

Kept free of torch at import: this module is reachable from `kvray --help`.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cluster.bench.common.model_arg import add_model_argument, bench_model_dir
from cluster.bench.step.probes import (
    StepClock,
    count_step_ops,
    kv_bytes_per_token,
    weight_bytes_read,
)
from cluster.bench.step.report import (
    StepRow,
    copy_bandwidth,
    describe_machine,
    format_table,
    machine_info,
    payload,
    timing_notes,
)
from workers.config import ATTENTION_BACKENDS, DEFAULT_MAX_NUM_BATCHED_TOKENS


@dataclass(frozen=True)
class StepSettings:
    model: str | None = None
    batch_sizes: tuple[int, ...] = (1, 8, 64)
    context: int = 512
    prefill_tokens: int = 2048
    steps: int = 20
    warmup: int = 3
    prefill_steps: int = 5
    dtype: str = "auto"
    device: str | None = None
    compile: bool | None = None
    attention_backend: str = "auto"
    cpu_kernels: bool = True
    seed: int = 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    add_model_argument(parser)
    a("--batch-sizes", type=_int_list, default=(1, 8, 64), help="decode batches (default 1,8,64)")
    a("--context", type=int, default=512, help="prompt tokens of each decode sequence (512)")
    a(
        "--prefill-tokens",
        type=int,
        default=2048,
        help="tokens of the prefill step, in one chunk (default 2048; capped to max_model_len - 1)",
    )
    a("--steps", type=int, default=20, help="timed decode steps per batch size (default 20)")
    a("--warmup", type=int, default=3, help="decode steps before the timed ones (default 3)")
    a("--prefill-steps", type=int, default=5, help="timed prefill steps, after one warm-up (5)")
    a("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    a("--device", default=None, help="cpu | cuda (default: cuda if available)")
    a(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile the forward (default: the engine's, off)",
    )
    a("--attention-backend", choices=ATTENTION_BACKENDS, default="auto")
    a("--no-cpu-kernels", action="store_true", help="torch's ops instead of the CPU C kernels")
    a("--seed", type=int, default=0)
    a("--result-json", default=None, metavar="FILE", help="write the results as JSON")


def run(args: argparse.Namespace) -> int:
    settings = StepSettings(
        model=args.model,
        batch_sizes=tuple(args.batch_sizes),
        context=args.context,
        prefill_tokens=args.prefill_tokens,
        steps=args.steps,
        warmup=args.warmup,
        prefill_steps=args.prefill_steps,
        dtype=args.dtype,
        device=args.device,
        compile=args.compile,
        attention_backend=args.attention_backend,
        cpu_kernels=not args.no_cpu_kernels,
        seed=args.seed,
    )
    if min(*settings.batch_sizes, settings.context, settings.prefill_tokens) < 1:
        raise SystemExit("--batch-sizes, --context and --prefill-tokens must be positive")
    if min(settings.steps, settings.prefill_steps) < 1 or settings.warmup < 0:
        raise SystemExit("--steps and --prefill-steps must be positive, --warmup at least 0")
    result = measure(settings)
    print()
    print(format_table(result["rows"], result["cuda"]))
    for note in timing_notes(result["cuda"]):
        print(f"  {note}")
    if args.result_json:
        from cluster.bench.common.result import write_result_json

        skip = ("rows", "cuda", "settings", "machine")
        extra = {k: v for k, v in result.items() if k not in skip}
        write_result_json(
            args.result_json,
            payload(result["rows"], result["settings"], result["machine"], **extra),
        )
        print(f"\nwrote {args.result_json}")
    return 0


def measure(s: StepSettings) -> dict[str, Any]:
    """Builds the engine, measures every case; returns the rows and what they were run on."""
    from workers.sampling_params import SamplingParams

    model_dir = bench_model_dir(s.model)
    engine, prefill = _engine(s, model_dir)
    worker = engine.executor.worker
    cuda = worker.device.type == "cuda"
    machine = machine_info(str(worker.device))
    print(
        f"kvray bench step: {model_dir}, {engine.config.dtype} on {worker.device}, {worker.info()}"
    )
    print(describe_machine(machine))
    copy_bps = copy_bandwidth(str(worker.device))
    print(f"copy bandwidth (read + write): {copy_bps / 1e9:.1f} GB/s")
    from cluster.bench.common.workload import sampleable_token_ids

    token_ids = sampleable_token_ids(model_dir)
    rng = random.Random(s.seed)
    # CUDA graphs of decode steps (the torch backend's piecewise ones or the triton backend's
    # whole-step ones), read before the clock wraps the worker's forward.
    graphs = getattr(worker.forward.compiled, "graphs", None)
    clock = StepClock(worker, cuda)
    per_token_kv = kv_bytes_per_token(engine)
    rows: list[StepRow] = []
    try:
        for b in s.batch_sizes:
            prompts = [rng.choices(token_ids, k=s.context) for _ in range(b)]
            max_tokens = _max_tokens(s, b, _budget(s, prefill))
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            rows.append(_decode_case(engine, clock, prompts, params, s, per_token_kv, copy_bps))
        prompts = [rng.choices(token_ids, k=prefill) for _ in range(s.prefill_steps + 2)]
        rows.append(_prefill_case(engine, clock, prompts, per_token_kv, copy_bps))
    finally:
        engine.shutdown()
    replays = None if graphs is None else graphs.replays
    if replays is not None:
        print(f"decode steps replayed from CUDA graphs: {replays}")
    settings = {**vars(s), "model": str(model_dir), "prefill_tokens": prefill}
    settings["batch_sizes"] = list(s.batch_sizes)
    return {
        "rows": rows,
        "cuda": cuda,
        "settings": settings,
        "machine": machine,
        "device": str(worker.device),
        "dtype": engine.config.dtype,
        "worker": worker.info(),
        "layers": engine.config.model.num_layers,
        "copy_bytes_per_s": copy_bps,
        "graph_replays": replays,
        "notes": timing_notes(cuda),
    }


def _decode_case(
    engine: Any,
    clock: StepClock,
    prompts: list[list[int]],
    params: Any,
    s: StepSettings,
    per_token_kv: float,
    copy_bps: float,
) -> StepRow:
    from tqdm import tqdm

    b = len(prompts)
    ids = [f"decode-{b}-{i}" for i in range(b)]
    seqs = [
        q
        for rid, p in zip(ids, prompts, strict=True)
        for q in engine.add_prompt(rid, p, params).seqs
    ]
    while not all(q.prefill_done for q in seqs):  # prompts in chunks, some decoding already
        engine.step()
    for _ in range(s.warmup):
        engine.step()
    clock.reset()
    step_ms, attended = [], []
    for _ in tqdm(range(s.steps), desc=f"decode B={b}", unit="step", leave=False):
        attended.append(sum(q.num_tokens for q in seqs))  # the step attends every position
        step_ms.append(_timed(engine.step))
    counts = list(engine.step_token_counts)[-s.steps :]
    if counts != [b] * s.steps or any(q.finished for q in seqs):
        raise RuntimeError(f"decode B={b}: steps were not decode-only ({counts})")
    execute_ms, device_ms = clock.take(s.steps)
    ops = count_step_ops(engine.step, clock.cuda)
    for rid in ids:
        engine.abort(rid)
    return StepRow(
        case="decode",
        batch=b,
        tokens=b,
        context=sum(attended) / len(attended) / b,
        step_ms=step_ms,
        execute_ms=execute_ms,
        device_ms=device_ms,
        layers=engine.config.model.num_layers,
        weight_bytes=weight_bytes_read(engine.executor.worker, b),
        kv_bytes=per_token_kv * sum(attended) / len(attended),
        copy_bytes_per_s=copy_bps,
        **ops,
    )


def _prefill_case(
    engine: Any, clock: StepClock, prompts: list[list[int]], per_token_kv: float, copy_bps: float
) -> StepRow:
    """One step per prompt: its whole prompt in one chunk, one token sampled. The first is a
    warm-up, the last is the step whose ops are counted."""
    from tqdm import tqdm

    from workers.sampling_params import SamplingParams

    n = len(prompts[0])
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    step_ms = []
    for i, prompt in enumerate(tqdm(prompts[:-1], desc=f"prefill {n}", unit="step", leave=False)):
        engine.add_prompt(f"prefill-{i}", prompt, params)
        if i == 1:
            clock.reset()
        ms = _timed(engine.step)
        if engine.step_token_counts[-1] != n or engine.has_unfinished():
            raise RuntimeError(
                f"prefill {n}: not one chunk ({engine.step_token_counts[-1]} tokens)"
            )
        if i >= 1:
            step_ms.append(ms)
    execute_ms, device_ms = clock.take(len(step_ms))
    engine.add_prompt("prefill-ops", prompts[-1], params)
    ops = count_step_ops(engine.step, clock.cuda)
    return StepRow(
        case="prefill",
        batch=1,
        tokens=n,
        context=float(n),
        step_ms=step_ms,
        execute_ms=execute_ms,
        device_ms=device_ms,
        layers=engine.config.model.num_layers,
        weight_bytes=weight_bytes_read(engine.executor.worker, n),
        kv_bytes=per_token_kv * n,  # the chunk's own K/V, read at least once
        copy_bytes_per_s=copy_bps,
        **ops,
    )


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _engine(s: StepSettings, model_dir: Path) -> tuple[Any, int]:
    """An offline engine sized for the cases (a KV cache that holds the largest one, a token
    budget that takes the prefill in one chunk); returns it and the prefill's length."""
    from workers.config import EngineArgs
    from workers.core.engine import LLMEngine
    from workers.kv_layout import kv_block_bytes

    args = EngineArgs(
        model=str(model_dir),
        dtype=s.dtype,
        device=s.device,
        compile=s.compile,
        attention_backend=s.attention_backend,
        cpu_kernels=s.cpu_kernels,
        enable_prefix_caching=False,  # random prompts; every prefill computes its tokens
        max_num_seqs=max(s.batch_sizes),
        seed=s.seed,
    )
    probe = args.create_config()
    max_len = probe.scheduler.max_model_len
    prefill = min(s.prefill_tokens, max_len - 1)
    if prefill < s.prefill_tokens:
        print(f"--prefill-tokens capped to {prefill} (max_model_len {max_len})")
    budget = _budget(s, prefill)
    bs = probe.cache.block_size
    need = max(s.context + _max_tokens(s, b, budget) for b in s.batch_sizes)
    if need > max_len:
        raise SystemExit(
            f"--context {s.context} plus the steps' tokens ({need - s.context}) exceed "
            f"max_model_len {max_len}"
        )
    blocks = max(
        max(b * -(-(s.context + _max_tokens(s, b, budget)) // bs) for b in s.batch_sizes),
        -(-(prefill + 1) // bs),
    )
    per_block = kv_block_bytes(probe, 1)
    kv_bytes = int(blocks * 1.1 + 16) * per_block
    # max_model_len as long as the cases need, so the small cache does not cap it (a warning).
    args = replace(
        args,
        max_model_len=max(need, prefill + 1),
        max_num_batched_tokens=budget,
        kv_cache_memory_bytes=kv_bytes,
    )
    return LLMEngine(args.create_config(), progress=True), prefill


def _budget(s: StepSettings, prefill: int) -> int:
    """The step's token budget: the prefill in one chunk, and room to fill the decode batches
    with prompt chunks beside their running decodes."""
    return max(prefill, DEFAULT_MAX_NUM_BATCHED_TOKENS, 2 * max(s.batch_sizes))


def _max_tokens(s: StepSettings, batch: int, budget: int) -> int:
    """Enough output tokens that no sequence of the batch finishes before its case ends: the
    steps filling the batch's prompts (decodes share their budget), warm-up, timed, counted."""
    fill = -(-batch * s.context // (budget - batch)) + 1
    return fill + s.warmup + s.steps + 3


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers separated by commas: {text!r}"
        ) from None

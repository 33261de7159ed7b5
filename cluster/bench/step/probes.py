"""What `kvray bench step` observes of one engine step, from outside the engine: the
worker's timings (by wrapping its attributes), the ops a step runs, the bytes it must read.

Kept free of torch at import: this module is reachable from `kvray --help`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

# Host calls that start work on a CUDA device (torch.profiler's runtime events).
_LAUNCH_CALLS = frozenset(
    {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"}
    | {"cudaGraphLaunch", "cuGraphLaunch"}
)
TOP_OPS = 12  # the most frequent ops kept in the JSON


class StepClock:
    """Times each `Worker.execute` and, inside it, the forward and sampling, by wrapping the
    worker's attributes (instance attributes shadow its methods): the forward's start is marked
    when the step's hidden states are asked for, its end after `_execute` returns, once the
    sampled ids' copy to the host is queued (CUDA: events; CPU: the host's clock)."""

    def __init__(self, worker: Any, cuda: bool) -> None:
        self.cuda = cuda
        self.execute_ms: list[float] = []
        self.device_ms: list[float] = []
        self._start: Any = None
        execute, inner = worker.execute, worker._execute
        worker.forward = ForwardProbe(worker.forward, self._mark)

        def timed_execute(step: Any) -> Any:
            self.execute_ms.append(0.0)
            t0 = time.perf_counter()
            try:
                return execute(step)
            finally:
                self.execute_ms[-1] = (time.perf_counter() - t0) * 1e3

        def timed_inner(step: Any) -> Any:
            self._start = None
            out = inner(step)
            if self._start is not None:
                self.device_ms.append(self._since_mark())
            return out

        worker.execute, worker._execute = timed_execute, timed_inner

    def _mark(self) -> None:
        if self.cuda:
            import torch

            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def _since_mark(self) -> float:
        if not self.cuda:
            return (time.perf_counter() - self._start) * 1e3
        import torch

        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return self._start.elapsed_time(end)

    def reset(self) -> None:
        self.execute_ms.clear()
        self.device_ms.clear()

    def take(self, n: int) -> tuple[list[float], list[float]]:
        """The last `n` steps' execute and device times (each step ran one forward)."""
        if len(self.execute_ms) != n or len(self.device_ms) != n:
            raise RuntimeError(
                f"expected {n} worker steps, timed {len(self.execute_ms)} executes and "
                f"{len(self.device_ms)} forwards"
            )
        return list(self.execute_ms), list(self.device_ms)


class ForwardProbe:
    """The worker's `ModelForward` with a mark when a step's hidden states are asked for."""

    def __init__(self, forward: Any, mark: Callable[[], None]) -> None:
        self._forward, self._mark = forward, mark

    def __getattr__(self, name: str) -> Any:
        return getattr(self._forward, name)

    def hidden_states(self, *args: Any) -> Any:
        self._mark()
        return self._forward.hidden_states(*args)

    def eager_hidden_states(self, *args: Any) -> Any:
        self._mark()
        return self._forward.eager_hidden_states(*args)


def count_ops(fn: Callable[[], Any]) -> Counter[str]:
    """The torch ops (`namespace::name`, overloads merged) that `fn` dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: Counter[str] = Counter()

    class _OpCounter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            counts[func.name().split(".", 1)[0]] += 1
            return func(*args, **(kwargs or {}))

    with _OpCounter():
        fn()
    return counts


def count_kernels(fn: Callable[[], Any]) -> tuple[Counter[str], int, float]:
    """The CUDA kernels `fn` runs (by name), the host's launch calls, the kernels' busy ms."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels: Counter[str] = Counter()
    launches, busy_us = 0, 0.0
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            if not e.name.startswith(("Memcpy", "Memset")):
                kernels[e.name[:80]] += 1
                busy_us += e.time_range.elapsed_us()
        elif e.name in _LAUNCH_CALLS:
            launches += 1
    return kernels, launches, busy_us / 1e3


def count_step_ops(step: Callable[[], Any], cuda: bool) -> dict[str, Any]:
    """One step's ops as StepRow's fields: torch ops on CPU, kernels on CUDA."""
    if not cuda:
        ops = count_ops(step)
        return {"ops": sum(ops.values()), "ops_by_name": dict(ops.most_common(TOP_OPS))}
    kernels, launches, busy_ms = count_kernels(step)
    return {
        "ops": sum(kernels.values()),
        "ops_by_name": dict(kernels.most_common(TOP_OPS)),
        "launches": launches,
        "kernel_busy_ms": busy_ms,
    }


def weight_bytes_read(worker: Any, tokens: int) -> int:
    """Weight bytes one step reads: every parameter and packed copy once (`param_bytes`),
    except the embedding table, of which only the step's rows are read, unless the LM head
    reads it whole (tied, without a packed copy). Mixture-of-experts layers count every
    expert: an upper bound."""
    total = worker.param_bytes()
    embed = getattr(worker.model, "embed_tokens", None)
    head = getattr(worker.model, "lm_head", None)
    w = getattr(embed, "weight", None)
    if w is None or w.is_meta:
        return total
    if head is not None and head.weight is w and getattr(head, "packed_weight", None) is None:
        return total
    return total - w.numel() * w.element_size() + tokens * w.shape[1] * w.element_size()


def kv_bytes_per_token(engine: Any) -> float:
    from workers.kv_layout import kv_block_bytes

    return kv_block_bytes(engine.config, 1) / engine.config.cache.block_size

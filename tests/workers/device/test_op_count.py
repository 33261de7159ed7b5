"""The host's work per decode step, counted as dispatched aten ops per decoder layer: the torch
path against the triton backend, whose layers run the fused kernels of
workers/device/layers/triton_layers.py (and triton_attention.py).

Counting: a TorchDispatchMode sees every aten op the step dispatches. A Triton launch counts
as one op: under the interpreter (these tests, on CPU) a launch runs the kernel in Python and
numpy and dispatches aten ops of its own (copies to and from numpy), which a GPU launch does
not, so each kernel object of the two modules (`*_kernel`) is wrapped while the test runs: its
launch counts one and switches the mode's counting off until it returns. A layer's ops are
those from its qkv projection to the next layer's (its own norms and residual adds, whichever
layer a fused add lands in, once each).

Measured on the tiny checkpoints (batch of 8 decodes, per layer): the torch path (CPU kernels
off) 64 ops for llama, 80 for qwen3 (its q/k norms); the triton backend 17 and 19.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.checkpoints import hf_greedy, load_hf
from tests.triton_interpret import interpreted_kernels
from tests.workers.parity import assert_greedy_match
from workers import LLM, SamplingParams

BATCH = 8
MAX_TOKENS = 4
# The triton backend's target: host work of a decode step, per layer.
TRITON_MAX_OPS_PER_LAYER = 20


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while `on`, except inside a Triton launch."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False
        self.in_launch = False
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if self.on and not self.in_launch:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


class CountedKernel:
    """A kernel whose launches (`kernel[grid](...)`) count as one op each."""

    def __init__(self, kernel: Any, name: str, counter: OpCounter) -> None:
        self.kernel, self.name, self.counter = kernel, name, counter

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        launch = self.kernel[grid]

        def run(*args: Any, **kwargs: Any) -> Any:
            c = self.counter
            if c.on and not c.in_launch:
                c.ops[f"triton launch {self.name}"] += 1
            outer, c.in_launch = c.in_launch, True
            try:
                return launch(*args, **kwargs)
            finally:
                c.in_launch = outer

        return run


@pytest.fixture(scope="module")
def kernel_modules() -> Iterator[tuple[ModuleType, ModuleType]]:
    """triton_attention and triton_layers with their kernels interpreted."""
    for attention in interpreted_kernels():  # skips without triton
        for layers in interpreted_kernels(
            "workers.device.layers.triton_layers", "_rms_norm_kernel"
        ):
            yield attention, layers


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (3 + 2 * i,), generator=g).tolist() for i in range(BATCH)]


def _run(
    path: Path, backend: str, modules: tuple[ModuleType, ...], mp: pytest.MonkeyPatch
) -> tuple[list[list[int]], list[Counter[str]], list[list[int]]]:
    """Greedy outputs of BATCH prompts, and the ops of each layer of the first decode step."""
    llm = LLM(
        str(path), kv_cache_memory_bytes=16 << 20, attention_backend=backend, cpu_kernels=False
    )
    model = llm.engine.executor.worker.model
    counter = OpCounter()
    for mod in modules:
        for name in [n for n in vars(mod) if n.endswith("_kernel")]:
            mp.setattr(mod, name, CountedKernel(getattr(mod, name), name, counter))
    layers: list[Counter[str]] = []

    def layer_starts(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if counter.on:
            layers.append(counter.ops)
        if args[0].shape[0] == BATCH and len(layers) < len(model.layers) - 1:
            counter.ops, counter.on = Counter(), True  # a decode step: every row one token
        else:
            counter.on = False

    for layer in model.layers:
        layer.self_attn.qkv_proj.register_forward_pre_hook(layer_starts)
    prompts = _prompts(llm.engine.vocab_size)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with counter:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return prompts, layers, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_triton_layers_cut_the_ops_per_layer(
    kernel_modules: tuple[ModuleType, ...], checkpoints: dict[str, Path], kind: str
) -> None:
    """At most TRITON_MAX_OPS_PER_LAYER ops per layer on the triton backend (each launch one
    op), against 64-80 on the torch path (reported in the message, not bounded); the same
    greedy tokens on both paths, and transformers' up to near-ties."""
    with pytest.MonkeyPatch.context() as mp:
        prompts, torch_layers, torch_out = _run(checkpoints[kind], "torch", (), mp)
    with pytest.MonkeyPatch.context() as mp:
        _, triton_layers, triton_out = _run(checkpoints[kind], "triton", kernel_modules, mp)
    assert torch_layers and triton_layers, "no decode step of the whole batch was counted"
    seen = [sum(c.values()) for c in torch_layers], [sum(c.values()) for c in triton_layers]
    report = f"{kind}: ops per layer of a decode step: torch {seen[0]}, triton {seen[1]}"
    launches = sum(n for op, n in triton_layers[0].items() if op.startswith("triton launch"))
    assert launches >= 5, f"{report}; the launches went uncounted: {dict(triton_layers[0])}"
    assert max(seen[1]) <= TRITON_MAX_OPS_PER_LAYER, f"{report}: {dict(triton_layers[0])}"
    assert triton_out == torch_out, report
    hf = load_hf(checkpoints[kind])
    for prompt, ours in zip(prompts, triton_out, strict=True):
        assert_greedy_match(hf, prompt, ours, hf_greedy(hf, prompt, MAX_TOKENS))

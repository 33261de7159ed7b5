"""How a worker runs its model's forward pass, chosen once at its start.

`ForwardStrategy.choose` decides from the device, the dtype, the kernels' availability and
the compile config; `ModelForward` holds what the strategy needs (the compiled pieces, the
direct layer calls) and is what the worker calls each step. Paths:
- torch: the modules on torch's ops (CUDA, dtypes other than float32, kernels off);
- kernels: on CPU in float32 the modules run the C kernels as `kvray::` ops; eager steps
  whose every token is a kernel row run the layers as direct kernel calls instead
  (workers/device/models/cpu_layers.py), which give the same hidden states bit for bit;
- compiled (either of the above): the pieces around attention compiled
  (workers/device/compile.py) for the steps the compile config sends there, the kernels
  traced as custom ops; the other steps run eagerly as above.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from workers.compile_config import CompilationConfig
from workers.config import EngineConfig
from workers.device.layers.cpu_kernels import KernelState, kernel_state
from workers.device.layers.int8_linear import set_fast_path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ForwardStrategy:
    kernels: KernelState  # on (with the library) or off, and why
    compiled: bool  # the compile config asks for the compiled pieces (and TP allows them)

    @staticmethod
    def choose(
        device: torch.device,
        dtype: torch.dtype,
        compilation: CompilationConfig,
        kernels_enabled: bool = True,
        tp_size: int = 1,
    ) -> ForwardStrategy:
        kernels = kernel_state(device.type, dtype == torch.float32, kernels_enabled)
        return ForwardStrategy(kernels, compilation.enabled and tp_size == 1)

    @property
    def path(self) -> str:
        """ "torch" or "kernels", with "+compiled" when the compiled pieces serve some steps."""
        base = "kernels" if self.kernels.on else "torch"
        return f"{base}+compiled" if self.compiled else base


@dataclass(frozen=True)
class ModelForward:
    """A step's forward: `forward(input_ids, positions, kv_caches, meta, logits_indices)`
    returns the logits of the selected positions."""

    model: Any
    strategy: ForwardStrategy
    compiled: Any = None  # workers.device.compile.CompiledForward, or None: eager
    direct: Any = None  # workers.device.models.cpu_layers.CpuLayers, or None: the modules

    @property
    def path(self) -> str:
        """What runs, as `ForwardStrategy.path` says it, "+compiled" only when the compiled
        pieces were built (compiling can fail, and then every step runs eagerly)."""
        return dataclasses.replace(self.strategy, compiled=self.compiled is not None).path

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: Any,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        x = self.hidden_states(input_ids, positions, kv_caches, meta)
        return self.model.logits(x, logits_indices)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: Any,
    ) -> torch.Tensor:
        """[T, hidden] after the last layer, before the final norm: through the compiled
        pieces where they serve the step, else eagerly."""
        if self.compiled is not None:
            return self.compiled.hidden_states(
                self.model, input_ids, positions, kv_caches, meta, eager=self.eager_hidden_states
            )
        return self.eager_hidden_states(input_ids, positions, kv_caches, meta)

    def eager_hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: Any,
    ) -> torch.Tensor:
        """[T, hidden] after the last layer: through the direct kernel calls where every
        token of the step is a kernel row, else through the modules."""
        if self.direct is not None and meta.num_kernel_rows == input_ids.shape[0]:
            x = self.model.embed_tokens(input_ids)
            return self.direct.run(x, positions, kv_caches, meta)
        return self.model.hidden_states(input_ids, positions, kv_caches, meta)


def build_forward(
    model: torch.nn.Module,
    config: EngineConfig,
    device: torch.device,
    tp_size: int,
    progress: bool,
    triton: bool = False,
) -> tuple[ModelForward, int]:
    """The worker's forward (workers/device/forward.py), its strategy chosen here once, and
    the host bytes the packed bfloat16 weight copies added (negative: freed)."""
    strategy = ForwardStrategy.choose(
        device, config.torch_dtype, config.compilation, config.cpu_kernels, tp_size
    )
    packed_bytes, direct = 0, None
    # int8 (W8A16) projections: torch's int8 GEMM on CPU unless the fast CPU paths are off.
    if set_fast_path(model, config.cpu_kernels) and not config.cpu_kernels:
        log.info("int8 weights: dequantized in each forward (cpu_kernels off)")
    if strategy.kernels.on:
        from workers.device.layers.cpu_kernels import on_amx_tiles, use_cpu_kernels
        from workers.device.models.cpu_layers import CpuLayers

        lib = strategy.kernels.lib
        # The layers run the kernels as `kvray::` ops, eager and compiled alike; linears with
        # exactly-bfloat16 weights read packed copies (their float32 weights freed).
        packed_bytes = use_cpu_kernels(model, lib)
        # Eager steps run the layers as direct kernel calls, without the modules'
        # per-call Python (workers/device/models/cpu_layers.py).
        direct = CpuLayers.from_model(model, lib)
        if packed_bytes:
            log.info(
                "bfloat16 weights: the linear layers read packed bfloat16 copies "
                "(%+.0f MiB of host memory), %s",
                packed_bytes / 2**20,
                "on the AMX tiles (float32-accurate)"
                if on_amx_tiles(model)
                else "with FMA kernels",
            )
    from workers.device.compile import compile_model
    from workers.device.decode_graphs import full_graph_forward

    if triton:  # whole-step decode graphs, captured with the KV cache (Worker.init_kv_cache)
        compiled = full_graph_forward(
            config.compilation, model, tp_size, config.scheduler.max_num_seqs
        )
    else:
        compiled = compile_model(model, config.compilation, device, tp_size, progress)
    return ModelForward(model, strategy, compiled, direct), packed_bytes

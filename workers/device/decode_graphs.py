"""Whole decode steps as CUDA graphs, for the triton backend: one graph replay per step,
attention included.

With the triton backend every op of a decode step reads its inputs from device memory (the
attention kernels take the step's tables, workers/device/layers/triton_attention.py; the
norms, rotary and activations are Triton or torch ops of fixed shape), so the whole forward
-- embedding, every layer, the last hidden states -- can be captured once per batch size and
replayed: the host launches one graph instead of ~20 kernels per layer. The piecewise graphs
of workers/device/compile.py, which must leave attention out (the torch path's attention
metadata is Python data), remain for the torch backend.

A decode step of n sequences runs the graph of the smallest capture size B >= n: the model
runner lays the step out padded to B rows, at the addresses the graph of size B reads
(workers/device/triton_inputs.py), with one upload; padding rows attend to nothing and store
nothing. The graphs are captured after the KV cache exists (they read its blocks in place) and
the step buffer is allocated (they read its views), so the worker calls `capture` from
`init_kv_cache`.

Mixture-of-experts models are covered too: on this backend their experts run as grouped
GEMMs with no host sync (workers/device/layers/triton_moe.py), and the padding rows, which
are routed like any row, are left out of the experts' token counts.

Not covered (they run eagerly): prefill and mixed steps, steps with LoRA rows, and TP > 1
(the all-reduce would have to be captured with NCCL; not yet measured on a device).

On CPU, where there are no CUDA graphs (the triton backend runs there only under Triton's
interpreter, for tests), the same padded steps run the eager forward: everything but the
capture itself is tested without a GPU.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from workers.device.compile import eager_only, progress_bar
from workers.device.step_buffers import StepBuffers
from workers.device.triton_inputs import DecodePadding, triton_layout, upload_step

log = logging.getLogger(__name__)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None on CPU: the padded step runs eagerly
    out: torch.Tensor | None  # the captured forward's output: [B, hidden]


class FullDecodeGraphs:
    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.sizes = tuple(sorted(sizes))
        self.sets: dict[int, _Graph] = {}
        self.replays = 0  # decode steps served from the graphs (the GPU check reads it)
        self.padding: DecodePadding | None = None  # set by `capture`

    def capture(
        self,
        model: Any,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        buffers: StepBuffers,
        width: int,
        block_q: int,
        progress: bool = False,
    ) -> None:
        """One graph per size, largest first (smaller ones reuse the pool's memory), each
        over the views of `buffers` that a step padded to its size is uploaded to."""
        device = buffers.device
        cuda = device.type == "cuda"
        pool = torch.cuda.graph_pool_handle() if cuda else None
        sizes = sorted(self.sizes, reverse=True)
        for size in progress_bar(sizes, "capturing decode graphs", progress and cuda):
            ids, pos, meta = _idle_step(buffers, size, width, block_q)
            if not cuda:
                self.sets[size] = _Graph(None, None)
                continue
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                # Warm on the side stream first: Triton compiles each kernel on its first
                # launch, which a capture must not see.
                model.hidden_states(ids, pos, kv_caches, meta)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = model.hidden_states(ids, pos, kv_caches, meta)
            torch.cuda.current_stream(device).wait_stream(stream)
            self.sets[size] = _Graph(graph, out)
        if cuda:
            torch.cuda.synchronize(device)
        self.padding = DecodePadding(self.sizes, width)

    def hidden_states(
        self,
        model: Any,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: Any,
        eager: Any,
    ) -> torch.Tensor:
        """The step's hidden states: from its graph when the model runner padded it to a
        captured size, else from `eager`."""
        size = meta.triton.graph_size if meta.triton is not None else 0
        g = self.sets.get(size) if size else None
        if g is None:
            return eager(input_ids, positions, kv_caches, meta)
        self.replays += 1
        if g.graph is None:
            out = eager(input_ids, positions, kv_caches, meta)
        else:
            g.graph.replay()
            out = g.out
        return out[: meta.num_decodes]


class FullGraphForward:
    """`ModelForward.compiled` for the triton backend: the decode graphs above, and no
    torch.compile (the triton backend's layers are already fused kernels)."""

    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.graphs = FullDecodeGraphs(sizes)
        self.compile_s = 0.0

    def capture(self, model: Any, kv_caches: Any, buffers: StepBuffers, width: int,
                block_q: int, progress: bool = False) -> None:  # fmt: skip
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                self.graphs.capture(model, kv_caches, buffers, width, block_q, progress)
        except Exception:  # noqa: BLE001 - an op that cannot be captured: eager still serves
            log.exception("capturing the decode graphs failed; every step runs eagerly")
            self.graphs.sets.clear()
            self.graphs.padding = None
        self.compile_s = time.perf_counter() - t0
        if buffers.device.type == "cuda" and self.graphs.sets:
            log.info(
                "captured %d whole-step decode graphs (batch sizes %s) in %.1f s",
                len(self.graphs.sets),
                ", ".join(map(str, self.graphs.sizes)),
                self.compile_s,
            )

    def hidden_states(self, model: Any, input_ids: torch.Tensor, positions: torch.Tensor,
                      kv_caches: Any, meta: Any, eager: Any = None) -> torch.Tensor:  # fmt: skip
        return self.graphs.hidden_states(
            model, input_ids, positions, kv_caches, meta, eager or model.hidden_states
        )


def _idle_step(
    buffers: StepBuffers, size: int, width: int, block_q: int
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """A step of `size` padding rows in the graph layout, uploaded: what a capture runs."""
    layout = triton_layout(size, size, size, width, 0)
    ids, pos, slots, real, lens, cu, p_seq, p_qoff, _tables, _ = buffers.host_views(layout)
    ids[:], pos[:], slots[:], real[:], lens[:], cu[:], p_qoff[:] = 0, 0, -1, 0, 0, 0, 0
    p_seq[:] = range(size)
    d_ids, d_pos, meta, _ = upload_step(buffers, size, block_q, size)
    return d_ids, d_pos, meta


def full_graph_forward(config: Any, model: Any, tp_size: int, max_num_seqs: int
                       ) -> FullGraphForward | None:  # fmt: skip
    """The triton backend's compiled forward when the compile config asks for one (captured
    later, by `capture`), or None: eager (not asked, or TP > 1)."""
    from workers.compile_sizes import capture_sizes

    if not config.enabled:
        return None
    why = eager_only(model, tp_size, sync_free_experts=True)
    if why is not None:
        log.warning("decode graphs: %s runs the eager forward", why)
        return None
    return FullGraphForward(config.capture_sizes or capture_sizes(max_num_seqs))

"""The compiled forward pass: torch.compile of the pieces around attention, plus
CUDA graphs of decode-only batches.

Piecewise, as vLLM does: the paged attention stays eager (its metadata is per-step Python
data), and each decoder layer's two pieces around it
are compiled with inductor:
- pre-attention: input RMSNorm, q/k/v projection, q/k RMSNorm, rotary;
- post-attention: o projection + residual, post-attention RMSNorm, SiLU-and-mul MLP + residual.
Inductor fuses each elementwise chain (norms, rotary, SiLU * up, residual adds) into one loop
and leaves the matmuls to the BLAS. The layer is an argument of the compiled function, so
every layer runs the same graph (its weights are graph inputs): compiling costs two graphs,
not two per layer.

Shapes: the token dimension is compiled as an unbacked size (no 0/1 specialisation), so
each piece compiles once for every token count -- at start-up, in the warm-up below -- and
a CPU step pays no padding (padding to buckets would waste up to half a step's matmuls for
nothing on CPU). CUDA graphs need fixed shapes: decode-only batches are padded up to the
next capture size (workers/compile_sizes.py, like vLLM's capture sizes) and replay graphs
captured per size, piece and layer at start-up; larger or mixed batches run without graphs
(eagerly by default, see below). Graphs are only captured on CUDA; the CPU path never builds them.

Small steps run eagerly (`CompilationConfig.min_tokens`, 128 tokens on CPU): with OpenMP
threads that sleep when idle (OMP_WAIT_POLICY=PASSIVE), the compiled pieces' per-call
costs exceed what they save on small steps (measured: workers/compile_sizes.py). On CUDA
only the decode graphs run compiled (`CompilationConfig.graphs_only`): measured on an H200,
the graphs won 2.3-5x per decode step, while the pieces called directly lost to eager.

Not covered: TP > 1 (the row-parallel all-reduce sits inside the post-attention piece) and
mixture-of-experts models (the experts' groups depend on the routing) run eagerly.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from workers.compile_sizes import padded_size

if TYPE_CHECKING:
    from workers.compile_config import CompilationConfig

log = logging.getLogger(__name__)


def _pre(layer: Any, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return layer.pre_attention(positions, x)


def _post(layer: Any, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    return layer.post_attention(x, o)


class CompiledForward:
    """The compiled replacement of `LlamaForCausalLM.hidden_states` (see the module doc)."""

    def __init__(self, config: CompilationConfig) -> None:
        self.config = config
        # Fresh wrappers per model: dynamo keys its cache on the code, so models of one shape
        # share graphs; a different shape adds graphs (bounded by dynamo's recompile limit,
        # past which it runs the piece eagerly: same results).
        self.pre = torch.compile(_pre, dynamic=None, fullgraph=True)
        self.post = torch.compile(_post, dynamic=None, fullgraph=True)
        self.graphs: DecodeGraphs | None = None
        self.compile_s = 0.0

    def hidden_states(
        self,
        model: Any,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: Any,
        eager: Any = None,
    ) -> torch.Tensor:
        """`eager`: what runs the steps the compiled pieces do not (the model's
        `hidden_states` by default; the worker passes its own: workers/device/forward.py)."""
        if self.graphs is not None and not meta.prefills:
            out = self.graphs.run(model, input_ids, positions, kv_caches, meta)
            if out is not None:
                return out
        if self.config.graphs_only or input_ids.shape[0] < self.config.min_tokens:
            # No graph for this step on CUDA, or a small CPU step: the compiled pieces' per-call
            # cost exceeds their gain (CompilationConfig).
            return (eager or model.hidden_states)(input_ids, positions, kv_caches, meta)
        x = model.embed_tokens(input_ids)
        for layer, cache in zip(model.layers, kv_caches, strict=True):
            q, k, v = self.pre(layer, positions, x)
            x = self.post(layer, x, layer.self_attn.attn(q, k, v, cache, meta))
        return x

    def warm_up(self, model: Any, device: torch.device, progress: bool = False) -> float:
        """Compiles both pieces (once: the size 2 compiles, 1 and 7 check that no size
        recompiles) and, on CUDA with graphs on, captures the decode graphs; returns the
        seconds it took."""
        t0 = time.perf_counter()
        hidden = model.config.hidden_size
        with torch.inference_mode():
            # The token count is compiled as an unbacked size: one graph per piece serves
            # every count, 1 included (a backed size would specialise 1 and compile twice).
            for n in progress_bar((2, 1, 7), "compiling the forward pass", progress):
                x = torch.zeros(n, hidden, dtype=model.embed_tokens.weight.dtype, device=device)
                pos = torch.zeros(n, dtype=torch.long, device=device)
                torch._dynamo.decorators.mark_unbacked(x, 0)
                torch._dynamo.decorators.mark_unbacked(pos, 0)
                self._run_pieces(model, pos, x)
            if self.config.cuda_graphs and device.type == "cuda":
                self.graphs = DecodeGraphs(self.config.capture_sizes)
                self.graphs.capture(self, model, device, progress)
        self.compile_s = time.perf_counter() - t0
        return self.compile_s

    def _run_pieces(self, model: Any, pos: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Every layer's two pieces with a stand-in for attention (o = q): compiles them."""
        for layer in model.layers:
            q, _, _ = self.pre(layer, pos, x)
            o = q.clone()
            torch._dynamo.decorators.mark_unbacked(o, 0)
            x = self.post(layer, x, o)
        return x


class DecodeGraphs:
    """Piecewise CUDA graphs of decode-only batches, one set per capture size.

    For a size B: static buffers for positions and the embeddings, then per layer a graph of
    the pre-attention piece and one of the post-attention piece, chained through their own
    outputs (layer i's post output is layer i+1's pre input, so replay copies nothing but
    the attention output). Attention runs eagerly between the graphs on the real rows only.
    """

    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.sizes = sizes
        self.sets: dict[int, _GraphSet] = {}
        self.replays = 0  # decode steps served from the graphs (the GPU check reads it)

    def capture(self, fwd: CompiledForward, model: Any, device: torch.device, progress: bool):
        pool = torch.cuda.graph_pool_handle()
        # Largest first: later (smaller) captures reuse the pool's memory.
        sizes = sorted(self.sizes, reverse=True)
        for size in progress_bar(sizes, "capturing CUDA graphs", progress):
            self.sets[size] = _GraphSet(fwd, model, size, device, pool)
        torch.cuda.synchronize(device)

    def run(self, model, input_ids, positions, kv_caches, meta) -> torch.Tensor | None:  # noqa: ANN001
        n = input_ids.shape[0]
        size = padded_size(n, self.sizes)
        if size is None:
            return None
        self.replays += 1
        return self.sets[size].replay(model, input_ids, positions, kv_caches, meta, n)


class _GraphSet:
    def __init__(self, fwd: CompiledForward, model: Any, size: int, device, pool) -> None:  # noqa: ANN001
        dtype = model.embed_tokens.weight.dtype
        self.pos = torch.zeros(size, dtype=torch.long, device=device)
        self.x_in = torch.zeros(size, model.config.hidden_size, dtype=dtype, device=device)
        self.layers: list[tuple[Any, tuple[torch.Tensor, ...], torch.Tensor, Any]] = []
        x = self.x_in
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for layer in model.layers:
                fwd.pre(layer, self.pos, x)  # warm on the side stream, as capture requires
                g_pre = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g_pre, pool=pool, stream=stream):
                    qkv = fwd.pre(layer, self.pos, x)
                o = torch.zeros_like(qkv[0])
                fwd.post(layer, x, o)
                g_post = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g_post, pool=pool, stream=stream):
                    x_out = fwd.post(layer, x, o)
                self.layers.append((g_pre, qkv, o, g_post))
                x = x_out
        torch.cuda.current_stream(device).wait_stream(stream)
        self.x_out = x

    def replay(self, model, input_ids, positions, kv_caches, meta, n: int) -> torch.Tensor:  # noqa: ANN001
        self.x_in[:n].copy_(model.embed_tokens(input_ids))
        self.pos[:n].copy_(positions)
        for (g_pre, (q, k, v), o, g_post), layer, cache in zip(
            self.layers, model.layers, kv_caches, strict=True
        ):
            g_pre.replay()
            o[:n].copy_(layer.self_attn.attn(q[:n], k[:n], v[:n], cache, meta))
            g_post.replay()
        return self.x_out[:n]


def compile_model(
    model: Any,
    config: CompilationConfig,
    device: torch.device,
    tp_size: int,
    progress: bool = False,
) -> CompiledForward | None:
    """Compiles `model`'s forward when the config asks for it: the compiled pieces (their
    start-up seconds in `compile_s`), or None when the model runs eagerly (not asked, TP > 1,
    or compiling failed)."""
    if not config.enabled:
        return None
    why = eager_only(model, tp_size)
    if why is not None:
        log.warning("compile: %s runs the eager forward", why)
        return None
    fwd = CompiledForward(config)
    try:
        seconds = fwd.warm_up(model, device, progress)
    except Exception:  # noqa: BLE001 - no compiler, unsupported op: eager still serves
        log.exception("compiling the forward pass failed; running it eagerly")
        return None
    log.info("compiled the forward pass in %.1f s", seconds)
    return fwd


def eager_only(model: Any, tp_size: int, sync_free_experts: bool = False) -> str | None:
    """Why neither the compiled pieces nor any CUDA graph can serve this model (it then runs
    eagerly), or None. `sync_free_experts`: a mixture-of-experts model's experts run without a
    host sync (the triton backend's grouped GEMMs)."""
    if tp_size > 1:
        # The row-parallel all-reduce sits inside the post-attention piece (and a whole-step
        # graph); compiling or capturing through a gloo/NCCL call is not supported here yet.
        return f"tensor_parallel_size {tp_size} > 1"
    if getattr(model.config, "moe", None) is not None and not sync_free_experts:
        # The torch MoE MLP groups tokens by expert through a host sync, which no traced
        # piece or graph can hold.
        return "a mixture-of-experts model"
    return None


def progress_bar(items: Any, desc: str, enabled: bool) -> Any:
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit="size", dynamic_ncols=True)

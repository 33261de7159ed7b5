"""The decoder layers of a CPU step as a flat sequence of C kernel calls.

Why: once the C kernels took over the norms, rotary, attention and most linears, what was
left of a small step was Python. The module path spends about 190 us per layer on a decode
step (a dozen module calls, wrappers that check shapes and allocate each output, splits and
views): 2.9 of the 100M checkpoint's 8.3 ms per token for one sequence, two thirds of the
demo model's 1.1 ms. Here the buffers of a step are allocated once and shared by every
layer (all layers have the same shapes), each weight's address is read once at start-up,
and a layer is about fifteen direct calls.

The arithmetic is the module path's, call for call (the same kernels, and torch's BLAS
where the module path uses it): hidden states are bitwise equal
(tests/workers/device/models/test_cpu_layers.py), so is every token.

Used on CPU in float32 with the kernels loaded, when every module of every layer runs
through them (`CpuLayers.from_model`); the torch-native path, the compiled pieces and CUDA
keep the modules.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Any

import torch

from workers.device.layers.attention import AttentionMetadata
from workers.device.layers.cpu_kernels import amx_packed, check_gemm, register
from workers.device.layers.cpu_kernels.routing import kernel_route
from workers.device.layers.moe import SparseMoeBlock

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Linear:
    """One linear layer's tensors and their addresses (read once: the weights never move)."""

    weight: torch.Tensor  # [N, K] float32, or a meta tensor once the packed copy serves
    kernels: bool  # whether it runs through the GEMM kernels (`use_cpu_kernels` decided)
    packed: torch.Tensor | None  # the packed bfloat16 copy (cpu_kernels.pack_bf16_weight)
    amx: bool  # the copy is in csrc/amx_linear.c's layout, not csrc/bf16_linear.c's
    bias: torch.Tensor | None  # added here (column-parallel), or after the all-reduce
    n: int
    k: int
    weight_ptr: int
    packed_ptr: int
    bias_ptr: int | None
    lora: Any  # the layer's adapter slots (workers.lora.layers.LoraSlots), or None

    @classmethod
    def of(cls, module: Any, with_bias: bool = True) -> _Linear:
        w, packed = module.weight, module.packed_weight
        bias = module.bias if with_bias else None
        return cls(
            weight=w,
            kernels=module.cpu_kernels is not None,
            packed=packed,
            amx=packed is not None and amx_packed(packed),
            bias=bias,
            n=w.shape[0],
            k=w.shape[1],
            weight_ptr=0 if w.is_meta else w.data_ptr(),
            packed_ptr=0 if packed is None else packed.data_ptr(),
            bias_ptr=None if bias is None else bias.data_ptr(),
            lora=getattr(module, "lora", None),
        )


@dataclass(frozen=True)
class _Layer:
    input_norm: int  # weight addresses of the RMSNorms
    post_norm: int
    q_norm: int | None
    k_norm: int | None
    qkv: _Linear
    o: _Linear
    o_bias: torch.Tensor | None  # row-parallel: added once, after the all-reduce
    gate_up: _Linear
    down: _Linear
    down_bias: torch.Tensor | None


class CpuLayers:
    """Runs `model.layers` for one step: `run(x, positions, kv_caches, meta)` returns the
    hidden states after the last layer, as `LlamaForCausalLM.hidden_states` does."""

    def __init__(self, model: Any, lib: ctypes.CDLL) -> None:
        c = model.config
        first = model.layers[0]
        attn = first.self_attn
        self.lib = lib
        self.tp = model.tp
        self.eps = c.rms_norm_eps
        self.hidden = c.hidden_size
        self.num_heads = attn.num_heads
        self.num_kv_heads = attn.num_kv_heads
        self.head_dim = attn.head_dim
        self.q_size = attn.q_size
        self.kv_size = attn.kv_size
        self.inter = first.mlp.inter
        self.scale = attn.attn.scale
        self.qk_norm = attn.q_norm is not None
        rotary = attn.rotary
        self._cos, self._sin = rotary.cos.data_ptr(), rotary.sin.data_ptr()
        self.blockwise = attn.attn.blockwise  # the prefill kernel takes this head dim
        self.layers = [self._layer(layer) for layer in model.layers]

    @staticmethod
    def from_model(model: Any, lib: ctypes.CDLL | None) -> CpuLayers | None:
        """The runner, or None unless every module of every layer runs through `lib` (which
        `use_cpu_kernels` decides: dense float32 tensors), linear layers excepted: those may
        keep torch's linear (float32 weights on builds without AVX-512, every weight on builds
        narrower than AVX2)."""
        if lib is None:
            return None
        if any(isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers):
            # No kernel runs the experts: the layers keep the modules, whose attention, norms
            # and dense linears still call the kernels.
            log.info("mixture-of-experts model: the MoE MLP runs on torch ops")
            return None
        if getattr(model.config, "quantization", None) is not None:
            # No kernel reads FP8 or int8 weights: the layers keep the modules, whose
            # projections dequantize or run torch's int8 GEMM (fp8_linear.py, int8_linear.py).
            log.info("quantized checkpoint: its projections run as modules (no direct C calls)")
            return None
        if getattr(model.config, "gemma", None) is not None:
            # The calls below are Llama's layer (norms around the residual, SiLU): Gemma's
            # runs through its modules, whose norms, rotary, attention and linears call the
            # kernels (its GeGLU activation is torch's gelu).
            log.info("Gemma 3 model: its layers run as modules (no direct kernel calls)")
            return None
        handle = register(lib)
        for layer in model.layers:
            for module in layer.modules():
                if hasattr(module, "packed_weight"):
                    continue
                if hasattr(module, "cpu_kernels") and module.cpu_kernels != handle:
                    return None
        return CpuLayers(model, lib)

    @staticmethod
    def _layer(layer: Any) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        return _Layer(
            input_norm=layer.input_layernorm.weight.data_ptr(),
            post_norm=layer.post_attention_layernorm.weight.data_ptr(),
            q_norm=None if attn.q_norm is None else attn.q_norm.weight.data_ptr(),
            k_norm=None if attn.k_norm is None else attn.k_norm.weight.data_ptr(),
            qkv=_Linear.of(attn.qkv_proj),
            o=_Linear.of(attn.o_proj, with_bias=False),
            o_bias=attn.o_proj.bias,
            gate_up=_Linear.of(mlp.gate_up_proj),
            down=_Linear.of(mlp.down_proj, with_bias=False),
            down_bias=mlp.down_proj.bias,
        )

    def run(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """`x`: the step's embeddings [T, hidden] (updated in place: the residual stream)."""
        lib = self.lib
        t = x.shape[0]
        # On the kernel path every token of the step is a kernel row (prepare_inputs).
        assert meta.num_kernel_rows == t and not meta.prefills, "not a CPU kernel step"
        threads = max(1, torch.get_num_threads())
        h, kh, dh = self.num_heads, self.num_kv_heads, self.head_dim
        x = x.contiguous()
        # One set of buffers for every layer.
        f32 = {"dtype": torch.float32}
        normed = torch.empty(t, self.hidden, **f32)
        qkv = torch.empty(t, self.q_size + 2 * self.kv_size, **f32)
        q = torch.empty(t, h, dh, **f32)
        k = torch.empty(t, kh, dh, **f32) if self.qk_norm else qkv[:, self.q_size : -self.kv_size]
        k = k.view(t, kh, dh)
        v = qkv[:, self.q_size + self.kv_size :].view(t, kh, dh)
        q_view = qkv[:, : self.q_size].view(t, h, dh)
        attn_out = torch.empty(t, h * dh, **f32)
        delta = torch.empty(t, self.hidden, **f32)
        gate_up = torch.empty(t, 2 * self.inter, **f32)
        act = torch.empty(t, self.inter, **f32)
        positions = positions.to(torch.int64).contiguous()
        tables, lens = meta.decode_block_tables, meta.decode_lens
        chunks = meta.prefill_chunks if self.blockwise else None
        rows = t if chunks is None else meta.num_row_kernel_rows
        bs = kv_caches[0][0].shape[1] if kv_caches else 0
        max_blocks = tables.shape[1]
        scratch = torch.empty(threads * h * max_blocks * bs, **f32) if rows else None
        # Addresses read once per step (k_src: where the q/k norm reads k, in the fused qkv).
        px, pnormed, pqkv, pq, pk = (a.data_ptr() for a in (x, normed, qkv, q, k))
        pk_src, pattn, pdelta = (
            qkv[:, self.q_size :].data_ptr(),
            attn_out.data_ptr(),
            delta.data_ptr(),
        )
        pgate_up, pact, ppos = gate_up.data_ptr(), act.data_ptr(), positions.data_ptr()
        qkv_stride = qkv.stride(0)
        slots = meta.slot_mapping
        hid, eps = self.hidden, self.eps

        lib.rms_norm(px, self.layers[0].input_norm, pnormed, t, 1, hid, hid, hid, eps)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            self._linear(layer.qkv, normed, qkv, pnormed, pqkv, t, threads)
            if self.qk_norm:
                lib.rms_norm(pqkv, layer.q_norm, pq, t, h, qkv_stride, dh, dh, eps)
                lib.rms_norm(pk_src, layer.k_norm, pk, t, kh, qkv_stride, dh, dh, eps)
            else:
                q.copy_(q_view)  # the kernels read q contiguous; k is rotated in place
            lib.rotary(
                pq, h, h * dh, dh, pk, kh, k.stride(0), dh, t, dh, self._cos, self._sin, ppos
            )
            nb = k_cache.shape[0]
            k_cache.view(nb * bs, kh, dh).index_copy_(0, slots, k)
            v_cache.view(nb * bs, kh, dh).index_copy_(0, slots, v)
            if rows:
                lib.paged_decode_attention(
                    pq,
                    k_cache.data_ptr(),
                    v_cache.data_ptr(),
                    tables.data_ptr(),
                    lens.data_ptr(),
                    pattn,
                    scratch.data_ptr(),
                    rows,
                    h,
                    kh,
                    dh,
                    bs,
                    max_blocks,
                    max_blocks * bs,
                    threads,
                    self.scale,
                )
            if chunks is not None:
                status = lib.paged_prefill_attention(
                    pq,
                    k_cache.data_ptr(),
                    v_cache.data_ptr(),
                    tables.data_ptr(),
                    chunks.data_ptr(),
                    pattn,
                    chunks.shape[0],
                    h,
                    kh,
                    dh,
                    bs,
                    max_blocks,
                    threads,
                    self.scale,
                )
                if status != 0:
                    raise RuntimeError(f"paged_prefill_attention failed (head_dim {dh})")
            self._linear(layer.o, attn_out, delta, pattn, pdelta, t, threads)
            self._reduce(delta, layer.o_bias)
            lib.add_rms_norm(px, pdelta, layer.post_norm, pnormed, t, hid, eps)  # x += delta
            self._linear(layer.gate_up, normed, gate_up, pnormed, pgate_up, t, threads)
            lib.silu_and_mul(pgate_up, pact, t, self.inter)
            self._linear(layer.down, act, delta, pact, pdelta, t, threads)
            self._reduce(delta, layer.down_bias)
            if i + 1 < len(self.layers):  # x += delta, and the next layer's input norm
                lib.add_rms_norm(px, pdelta, self.layers[i + 1].input_norm, pnormed, t, hid, eps)
            else:
                x.add_(delta)
        return x

    def _linear(
        self,
        lin: _Linear,
        src: torch.Tensor,
        out: torch.Tensor,
        src_ptr: int,
        out_ptr: int,
        rows: int,
        threads: int,
    ) -> None:
        """out = src @ W.T (+ bias), routed as `workers.device.layers.linear.linear` routes it."""
        route = kernel_route(rows, lin.weight, lin.packed) if lin.kernels else None
        if route == "bf16":
            gemm = self.lib.amx_linear if lin.amx else self.lib.bf16_linear
            status = gemm(
                src_ptr, lin.packed_ptr, lin.bias_ptr, out_ptr, rows, lin.k, lin.n, threads
            )
            check_gemm(status)
        elif route == "skinny":
            self.lib.skinny_gemm(src_ptr, lin.weight_ptr, lin.bias_ptr, out_ptr, rows, lin.k, lin.n)
        elif lin.bias is not None:  # what nn.functional.linear runs, into the step's buffer
            torch.addmm(lin.bias, src, lin.weight.t(), out=out)
        else:
            torch.mm(src, lin.weight.t(), out=out)
        if lin.lora is not None and lin.lora.batch.active:
            lin.lora.add_to(src, out)  # a row-parallel layer's before its all-reduce, as there

    def _reduce(self, delta: torch.Tensor, bias: torch.Tensor | None) -> None:
        """A row-parallel layer's end: the all-reduce, then its bias once."""
        self.tp.all_reduce(delta)
        if bias is not None:
            delta.add_(bias)

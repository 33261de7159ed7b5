"""The Llama family (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k RMSNorm), and its
mixture-of-experts members (Qwen3-MoE, Mixtral: the sparse layers' MLP is
workers/device/layers/moe.py)."""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn
from torch.nn import functional as F

from workers.config import ModelConfig
from workers.device.distributed import TPGroup
from workers.device.layers.attention import AttentionMetadata, PagedAttention
from workers.device.layers.cpu_kernels import silu_and_mul_cpu
from workers.device.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from workers.device.layers.fp8_linear import column_parallel, row_parallel
from workers.device.layers.moe import SparseMoeBlock
from workers.device.layers.norm import RMSNorm
from workers.device.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    def __init__(
        self,
        c: ModelConfig,
        tp: TPGroup,
        dtype: torch.dtype,
        rotary: RotaryEmbedding,
        norm: type[RMSNorm] = RMSNorm,  # the q/k norms' class (Gemma's: GemmaRMSNorm)
        scale: float | None = None,  # None: head_dim ** -0.5
    ):
        super().__init__()
        self.num_heads = c.num_heads // tp.size
        self.num_kv_heads = c.kv_heads_per_rank(tp.size)
        self.head_dim = c.head_dim
        self.q_size = self.num_heads * c.head_dim
        self.kv_size = self.num_kv_heads * c.head_dim
        # FP8 projections for an FP8 checkpoint (workers/device/layers/fp8_linear.py).
        q = c.quantization
        sizes = [self.q_size, self.kv_size, self.kv_size]
        self.qkv_proj = column_parallel(q, c.hidden_size, sizes, c.qkv_bias, tp, dtype)
        self.o_proj = row_parallel(q, self.q_size, c.hidden_size, False, tp, dtype)
        self.q_norm = norm(c.head_dim, c.rms_norm_eps, dtype) if c.qk_norm else None
        self.k_norm = norm(c.head_dim, c.rms_norm_eps, dtype) if c.qk_norm else None
        self.rotary = rotary
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, c.head_dim, scale=scale or c.head_dim**-0.5
        )
        self.triton_layers: ModuleType | None = None  # set by triton_layers.use_triton_layers

    def forward(self, positions, x, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv(positions, x)
        return self.out(self.attn(q, k, v, kv_cache, meta))

    def qkv(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What comes before the paged attention: projections, q/k norm, rotary."""
        qkv = self.qkv_proj(x)
        if self.triton_layers is not None:
            # Two views instead of four, q/k normalised in place (one launch each).
            heads = [self.num_heads, self.num_kv_heads, self.num_kv_heads]
            q, k, v = qkv.view(qkv.shape[0], sum(heads), self.head_dim).split(heads, dim=1)
            if self.q_norm is not None:
                q, k = self.q_norm.fused(q, out=q), self.k_norm.fused(k, out=k)
            q, k = self.rotary(positions, q, k)
            return q, k, v
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return q, k, v

    def out(self, o: torch.Tensor) -> torch.Tensor:
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.inter = c.intermediate_size // tp.size
        q = c.quantization
        self.gate_up_proj = column_parallel(
            q, c.hidden_size, [self.inter, self.inter], False, tp, dtype
        )
        self.down_proj = row_parallel(q, self.inter, c.hidden_size, False, tp, dtype)
        self.cpu_kernels: int | None = None  # set by cpu_kernels.use_cpu_kernels
        self.triton_layers: ModuleType | None = None  # set by triton_layers.use_triton_layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.cpu_kernels is not None:
            return self.down_proj(silu_and_mul_cpu(self.cpu_kernels, gate_up))
        if self.triton_layers is not None:
            return self.down_proj(self.triton_layers.act_and_mul(gate_up))
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(
        self, c: ModelConfig, tp: TPGroup, dtype: torch.dtype, rotary: RotaryEmbedding, index: int
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.self_attn = Attention(c, tp, dtype, rotary)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.mlp: MLP | SparseMoeBlock
        if c.moe is not None and c.moe.is_sparse(index):
            self.mlp = SparseMoeBlock(c.hidden_size, c.moe, tp, dtype, c.quantization)
        else:
            self.mlp = MLP(c, tp, dtype)

    def forward(self, positions, x, kv_cache, meta) -> torch.Tensor:
        q, k, v = self.pre_attention(positions, x)
        return self.post_attention(x, self.self_attn.attn(q, k, v, kv_cache, meta))

    # The two pieces around the paged attention: workers/device/compile.py compiles them (the same
    # graph serves every layer: the layer is an argument) and keeps the attention eager.
    def pre_attention(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.self_attn.qkv(positions, self.input_layernorm(x))

    def post_attention(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn.out(o)
        return x + self.mlp(self.post_attention_layernorm(x))

    def fused_forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The triton backend's layer (`LlamaForCausalLM.hidden_states`): the residual adds
        folded into the norms that follow them, x updated in place. Adds `delta` (the previous
        layer's output; None for the first) to x and returns this layer's, for the next norm."""
        attn = self.self_attn
        h = self.input_layernorm.fused(x, delta, out=delta)
        o = attn.out(attn.attn(*attn.qkv(positions, h), kv_cache, meta))
        h = self.post_attention_layernorm.fused(x, o, out=o)
        if isinstance(self.mlp, SparseMoeBlock):  # padding rows stay out of its token counts
            return self.mlp(h, meta.triton.real_rows if meta.triton is not None else None)
        return self.mlp(h)


class LlamaForCausalLM(nn.Module):
    def __init__(self, c: ModelConfig, tp: TPGroup, dtype: torch.dtype, max_pos: int):
        super().__init__()
        c.check_tensor_parallel(tp.size)
        self.config = c
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, tp, dtype)
        rotary = RotaryEmbedding(c.rope, c.head_dim, max_pos, dtype)
        self.rotary = rotary
        self.layers = nn.ModuleList(
            DecoderLayer(c, tp, dtype, rotary, i) for i in range(c.num_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.lm_head = ParallelLMHead(
            self.embed_tokens if c.tie_word_embeddings else None,
            c.vocab_size,
            c.hidden_size,
            tp,
            dtype,
        )
        self.triton_layers: ModuleType | None = None  # set by triton_layers.use_triton_layers

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Returns logits [len(logits_indices), vocab] for the selected flattened positions:
        the eager modules (the worker's forward strategy, workers/device/forward.py, may run
        the compiled pieces or the direct kernel calls instead, then `logits`)."""
        x = self.hidden_states(input_ids, positions, kv_caches, meta)
        return self.logits(x, logits_indices)

    def logits(self, x: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """The final norm and LM head of the selected rows of the last layer's output."""
        return self.lm_head(self.norm(x[logits_indices]))

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The eager path: [T, hidden] after the last layer, before the final norm."""
        x = self.embed_tokens(input_ids)
        if self.triton_layers is not None:
            # Each layer's last residual add happens in the next layer's first norm.
            delta = None
            for layer, cache in zip(self.layers, kv_caches, strict=True):
                delta = layer.fused_forward(positions, x, delta, cache, meta)
            return x.add_(delta)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x = layer(positions, x, cache, meta)
        return x

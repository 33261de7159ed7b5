"""Gemma 3 text models (`Gemma3ForCausalLM`), on the Llama family's attention and linears.

What differs from Llama (transformers' modeling_gemma3.py, whose inference math this matches,
dtypes included):
- RMSNorm is x * (1 + w) in float32 (GemmaRMSNorm, the weight folded to 1 + w at load time),
  four per layer: the attention's and the MLP's outputs are normed before their residual add
  (post_attention_layernorm, post_feedforward_layernorm), the MLP's input by
  pre_feedforward_layernorm; q and k are normed per head;
- embeddings are scaled by sqrt(hidden_size), the scale rounded to the model dtype first;
- the MLP is GeGLU: gelu (tanh approximation) of the gate times up;
- attention scores are scaled by query_pre_attn_scalar ** -0.5;
- sliding-window layers rotate q and k with their own base (rope_local_base_freq), the global
  layers with the main rope and its scaling. The window itself needs no kernel: the engine
  caps max_model_len to it (EngineArgs.create_config), and within the window full causal
  attention is exactly sliding-window attention;
- the LM head is tied to the (unscaled) embeddings.

Settings: workers/gemma_config.py. On CPU the kernels run the norms (folded weight: the
kernel's x * w), rotary, attention and linears through the modules; the direct layer calls
(cpu_layers.py) are Llama's layer only and decline this model.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn
from torch.nn import functional as F

from workers.config import ModelConfig
from workers.device.distributed import TPGroup
from workers.device.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from workers.device.layers.linear import ColumnParallelLinear, RowParallelLinear
from workers.device.layers.norm import GemmaRMSNorm
from workers.device.layers.rotary import RotaryEmbedding
from workers.device.models.llama import Attention, LlamaForCausalLM


class ScaledEmbedding(VocabParallelEmbedding):
    """Embedding rows times sqrt(hidden_size); the scale is rounded to the model dtype before
    the product, as transformers does (in bfloat16 sqrt(3072) = 55.43 becomes 55.5)."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__(vocab_size, hidden, tp, dtype)
        scale = torch.tensor(hidden**0.5, dtype=torch.float32).to(dtype)
        self.register_buffer("scale", scale, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.scale


class GeGluMLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)), gate and up fused in one column-parallel projection."""

    def __init__(self, c: ModelConfig, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.inter = c.intermediate_size // tp.size
        self.gate_up_proj = ColumnParallelLinear(
            c.hidden_size, [self.inter, self.inter], False, tp, dtype
        )
        self.down_proj = RowParallelLinear(self.inter, c.hidden_size, False, tp, dtype)
        self.triton_layers: ModuleType | None = None  # set by triton_layers.use_triton_layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.triton_layers is not None:
            return self.down_proj(self.triton_layers.act_and_mul(self.gate_up_proj(x), gelu=True))
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self, c: ModelConfig, tp: TPGroup, dtype: torch.dtype, rotary: RotaryEmbedding
    ) -> None:
        super().__init__()
        assert c.gemma is not None
        h, eps = c.hidden_size, c.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.self_attn = Attention(c, tp, dtype, rotary, norm=GemmaRMSNorm, scale=c.gemma.scale)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.mlp = GeGluMLP(c, tp, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype)

    def forward(self, positions, x, kv_cache, meta) -> torch.Tensor:  # noqa: ANN001
        q, k, v = self.pre_attention(positions, x)
        return self.post_attention(x, self.self_attn.attn(q, k, v, kv_cache, meta))

    # The two pieces around the paged attention, as Llama's layer has them (compile.py).
    def pre_attention(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.self_attn.qkv(positions, self.input_layernorm(x))

    def post_attention(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn.out(o))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    def fused_forward(self, positions, x, delta, kv_cache, meta) -> torch.Tensor:  # noqa: ANN001
        """Llama's `fused_forward` (the triton backend) over Gemma's four norms: the normed
        outputs written over the tensors they norm, the residual adds folded into the norms
        that follow them."""
        attn = self.self_attn
        h = self.input_layernorm.fused(x, delta, out=delta)
        o = attn.out(attn.attn(*attn.qkv(positions, h), kv_cache, meta))
        o = self.post_attention_layernorm.fused(o, out=o)
        m = self.mlp(self.pre_feedforward_layernorm.fused(x, o, out=o))
        return self.post_feedforward_layernorm.fused(m, out=m)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Llama's `forward`, `hidden_states` and `logits` over Gemma 3's modules: every difference
    lives in the modules built here."""

    def __init__(self, c: ModelConfig, tp: TPGroup, dtype: torch.dtype, max_pos: int):
        nn.Module.__init__(self)  # not Llama's __init__: these modules replace its modules
        assert c.gemma is not None
        c.check_tensor_parallel(tp.size)
        self.config = c
        self.tp = tp
        self.embed_tokens = ScaledEmbedding(c.vocab_size, c.hidden_size, tp, dtype)
        # Global layers: the main rope (with its scaling); sliding layers: the local base.
        self.rotary = RotaryEmbedding(c.rope, c.head_dim, max_pos, dtype)
        self.local_rotary = RotaryEmbedding(c.gemma.local_rope, c.head_dim, max_pos, dtype)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(
                c, tp, dtype, self.local_rotary if c.gemma.is_sliding(i) else self.rotary
            )
            for i in range(c.num_layers)
        )
        self.norm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.triton_layers: ModuleType | None = None  # set by triton_layers.use_triton_layers
        self.lm_head = ParallelLMHead(
            self.embed_tokens if c.tie_word_embeddings else None,
            c.vocab_size,
            c.hidden_size,
            tp,
            dtype,
        )

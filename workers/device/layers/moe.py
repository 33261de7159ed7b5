"""The mixture-of-experts MLP: a router picks `top_k` of `num_experts` gated-SiLU experts per
token, and the token's output is their outputs weighted by the router's probabilities.

The arithmetic follows transformers' inference code for Qwen3-MoE and Mixtral, step for step:
router logits in the model's dtype, softmax in float32, top-k of the probabilities, the top-k
renormalised to sum to 1 when the family does (`MoeConfig.renormalize`), then each expert's
output scaled by its weight and summed per token in expert order.

Batched by expert, never by token: the (token, expert) pairs of a step are sorted by expert,
so each active expert runs one gate/up and one down matmul over all its tokens, and an
expert no token picked costs nothing. Weights are stacked per layer ([E, 2I, H] gate/up and
[E, H, I] down), which keeps loading and sharding simple.

Tensor parallelism shards every expert's intermediate dimension (column-parallel gate/up,
row-parallel down), so the layer ends with one all-reduce after the weighted sum; the router
is replicated. Which experts and which slice of them a rank holds is `ExpertPartition`'s
answer alone (the loader asks it too): the place expert parallelism would start from.

An FP8 checkpoint's experts stay FP8 (`w13`, `w2` float8_e4m3fn with their stacked 128x128
scale grids `w13_scale_inv`, `w2_scale_inv`): each expert that has tokens is dequantized as
it runs (workers/device/layers/fp8_linear.py); the triton path dequantizes the layer's stack
for its grouped GEMMs (a transient full-precision copy of one layer's experts).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn
from torch.nn import functional as F

from workers.device.distributed import TPGroup
from workers.device.layers.fp8_linear import FP8_DTYPE, blocks, dequantize, scale_rows
from workers.moe_config import MoeConfig
from workers.quantization import QuantizationConfig


@dataclass(frozen=True)
class ExpertPartition:
    """The experts a rank holds ([first, first + count)) and its slice of their
    intermediate dimension ([inter_start, inter_start + inter_size))."""

    first_expert: int
    num_local_experts: int
    inter_start: int
    inter_size: int

    @staticmethod
    def of(moe: MoeConfig, tp: TPGroup) -> ExpertPartition:
        """Tensor parallelism: every rank holds every expert, a 1/tp slice of each. Expert
        parallelism: every rank holds 1/tp of the experts, whole. Either way each rank adds
        its share of every token's output and the layer's one all-reduce sums them: the
        tokens are on every rank already (the attention's all-reduce), so no dispatch is
        needed, and each rank reads only its own experts' weights."""
        if moe.expert_parallel:
            first, count = tp.shard(moe.num_experts, "the number of experts")
            return ExpertPartition(first, count, 0, moe.intermediate_size)
        start, size = tp.shard(moe.intermediate_size, "the experts' intermediate size")
        return ExpertPartition(0, moe.num_experts, start, size)

    def local_index(self, expert: int) -> int | None:
        """Where checkpoint expert `expert` sits in this rank's stacked weights (None: not here)."""
        i = expert - self.first_expert
        return i if 0 <= i < self.num_local_experts else None


class SparseMoeBlock(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        moe: MoeConfig,
        tp: TPGroup,
        dtype: torch.dtype,
        quant: QuantizationConfig | None = None,
    ):
        super().__init__()
        self.tp = tp
        self.top_k = moe.top_k
        self.num_experts = moe.num_experts
        self.renormalize = moe.renormalize
        self.weights_in_model_dtype = moe.weights_in_model_dtype
        self.partition = ExpertPartition.of(moe, tp)
        self.inter = self.partition.inter_size
        n = self.partition.num_local_experts
        # The router sees every expert on every rank: all ranks route tokens alike.
        self.gate = nn.Parameter(torch.empty(moe.num_experts, hidden_size, dtype=dtype))
        wdtype = dtype if quant is None else FP8_DTYPE
        self.w13 = nn.Parameter(torch.empty(n, 2 * self.inter, hidden_size, dtype=wdtype))
        self.w2 = nn.Parameter(torch.empty(n, hidden_size, self.inter, dtype=wdtype))
        self.w13_scale_inv: nn.Parameter | None = None  # FP8: the experts' block scales
        self.w2_scale_inv: nn.Parameter | None = None
        if quant is not None:
            h, i = blocks(hidden_size), blocks(self.inter)
            f32 = torch.float32
            self.w13_scale_inv = nn.Parameter(torch.empty(n, 2 * i, h, dtype=f32))
            self.w2_scale_inv = nn.Parameter(torch.empty(n, h, i, dtype=f32))
            self.register_buffer("w13_rows", scale_rows([self.inter] * 2), persistent=False)
            self.register_buffer("w2_rows", scale_rows([hidden_size]), persistent=False)
        for p in self.parameters():
            p.requires_grad_(False)
        # Tokens routed to each expert so far (a token counts for each of its top-k): the
        # per-expert load metric. On the device, summed without a host sync per step.
        self.register_buffer("expert_tokens", torch.zeros(moe.num_experts, dtype=torch.int64))
        # workers/device/layers/triton_layers.py's use_triton_layers sets it: the experts then
        # run as workers/device/layers/triton_moe.py's grouped GEMMs.
        self.triton_layers: ModuleType | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) of each token's top-k experts."""
        logits = F.linear(x, self.gate)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            weights = weights.to(logits.dtype)
        return weights, ids

    def forward(self, x: torch.Tensor, real_rows: torch.Tensor | None = None) -> torch.Tensor:
        """`real_rows` ([T] int64, 1 or 0): which rows are tokens, not a decode graph's padding
        (workers/device/triton_inputs.py); padding is routed like any row, counted nowhere."""
        weights, ids = self.route(x)
        # index_add_, not bincount: CUDA's bincount reads the largest id back to the host.
        flat = ids.reshape(-1)
        if real_rows is None:
            counts = torch.ones_like(flat)
        else:
            counts = real_rows[:, None].expand(ids.shape).reshape(-1)
        self.expert_tokens.index_add_(0, flat, counts)
        if self.triton_layers is not None:
            # The triton backend: grouped-GEMM launches that never sync with the host.
            from workers.device.layers.triton_moe import moe_experts

            p = self.partition
            w13, w2 = self.expert_weights(slice(None), x.dtype)
            return self.tp.all_reduce(moe_experts(x, weights, ids, w13, w2, p.first_expert))
        return self.tp.all_reduce(self.experts(x, weights, ids))

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's share of sum_j weights[t, j] * expert_{ids[t, j]}(x[t]), before the
        all-reduce: grouped by expert, one pair of matmuls per expert that has tokens."""
        t, k = ids.shape
        n_local = self.partition.num_local_experts
        flat = ids.reshape(-1) - self.partition.first_expert
        if n_local < self.num_experts:
            # Expert parallelism: pairs of experts held elsewhere sort last and are not run.
            flat = torch.where((flat >= 0) & (flat < n_local), flat, n_local)
        # Stable: within an expert, pairs stay in token order; across experts the sorted
        # order is expert order, which is the order transformers adds a token's k outputs in.
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=n_local + 1).tolist()[:n_local]
        held = sum(counts)
        order = order[:held]
        tokens = order // k
        xs = x.index_select(0, tokens)
        w = weights.reshape(-1).index_select(0, order).unsqueeze(-1)
        out = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):  # experts that got no token: skipped
            if n == 0:
                continue
            rows = slice(start, start + n)
            w13, w2 = self.expert_weights(e, x.dtype)
            gate, up = F.linear(xs[rows], w13).split(self.inter, dim=-1)
            y = F.linear(F.silu(gate) * up, w2)
            out[rows] = (y * w[rows]).to(out.dtype)
            start += n
        return torch.zeros_like(x).index_add_(0, tokens, out)

    def expert_weights(
        self, e: int | slice, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Local expert `e`'s (or a slice of the stack's) gate/up and down weights in `dtype`:
        the parameters themselves, or FP8 ones dequantized."""
        if self.w13_scale_inv is None or self.w2_scale_inv is None:
            return self.w13[e], self.w2[e]
        w13 = dequantize(self.w13[e], self.w13_scale_inv[e], self.w13_rows, dtype)
        return w13, dequantize(self.w2[e], self.w2_scale_inv[e], self.w2_rows, dtype)

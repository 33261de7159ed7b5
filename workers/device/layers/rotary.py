"""Rotary position embeddings (rotate-half layout) with default, linear and llama3 scaling."""

from __future__ import annotations

import math
from types import ModuleType

import torch
from torch import nn

from workers.config import RopeConfig
from workers.device.layers.cpu_kernels import rotary_cpu


def inverse_frequencies(rope: RopeConfig, head_dim: int, max_pos: int) -> torch.Tensor:
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv / rope.factor
    if rope.rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band
        # between them interpolated smoothly.
        old_ctx = rope.original_max_position_embeddings or max_pos
        low_wavelen = old_ctx / rope.low_freq_factor
        high_wavelen = old_ctx / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old_ctx / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv


class RotaryEmbedding(nn.Module):
    def __init__(self, rope: RopeConfig, head_dim: int, max_pos: int, dtype: torch.dtype) -> None:
        super().__init__()
        inv = inverse_frequencies(rope, head_dim, max_pos)
        t = torch.arange(max_pos, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)
        self.cpu_kernels: int | None = None  # set by cpu_kernels.use_cpu_kernels
        self.triton_layers: ModuleType | None = None  # set by triton_layers.use_triton_layers

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, KH, D], positions: [T]. The CPU kernel rotates q and k in
        place (they are fresh per step: the norms' outputs or views of the qkv projection), and
        so do the triton backend's kernels (one launch)."""
        if self.cpu_kernels is not None:
            return rotary_cpu(self.cpu_kernels, positions, q, k, self.cos, self.sin)
        if self.triton_layers is not None:
            return self.triton_layers.rotary_(positions, q, k, self.cos, self.sin)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _apply(q, cos, sin), _apply(k, cos, sin)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin

"""RMSNorm computed in float32 and cast back, matching the reference implementation bit for bit
(on CPU in float32 one C kernel call, equal up to float rounding:
workers/device/layers/cpu_kernels/)."""

from __future__ import annotations

import torch
from torch import nn

from workers.device.layers.cpu_kernels import rms_norm_cpu


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.cpu_kernels: int | None = None  # set by cpu_kernels.use_cpu_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernels is not None:
            return rms_norm_cpu(self.cpu_kernels, x, self.weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

"""RMSNorm computed in float32 and cast back, matching the reference implementation bit for bit
(on CPU in float32 one C kernel call, equal up to float rounding:
workers/device/layers/cpu_kernels/; with the triton backend one Triton launch, equal up to
the rounding of the sum of squares: workers/device/layers/triton_layers.py); Gemma's
x * (1 + w) variant, GemmaRMSNorm."""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from workers.device.layers.cpu_kernels import rms_norm_cpu


class RMSNorm(nn.Module):
    cast_first = True  # the normalised row cast to the dtype before the weight (Gemma: after)

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.cpu_kernels: int | None = None  # set by cpu_kernels.use_cpu_kernels
        self.triton_layers: ModuleType | None = None  # set by triton_layers.use_triton_layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernels is not None:
            return rms_norm_cpu(self.cpu_kernels, x, self.weight, self.eps)
        if self.triton_layers is not None:
            return self.fused(x)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def fused(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The triton kernel's norm (`use_triton_layers` must have run): x += residual in
        place first when given, the result written into `out` (x, or the residual's buffer:
        the callers' own fresh tensors) or a new tensor."""
        return self.triton_layers.rms_norm(x, self.weight, self.eps, residual, out, self.cast_first)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: x * (1 + w), all in float32, cast to x's dtype last.

    The weight is stored folded: `from_checkpoint` turns the checkpoint's w (zero-centred) into
    1 + w once at load time, in float32 after rounding w to the model dtype, which is the value
    transformers computes per call (`1.0 + self.weight.float()`), so the product is bit for bit
    its product. In float32 this is RMSNorm's arithmetic with that weight, so the CPU norm
    kernel (x * w) runs it unchanged."""

    cast_first = False

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__(dim, eps, dtype)
        self.model_dtype = dtype
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False)

    def from_checkpoint(self, w: torch.Tensor) -> torch.Tensor:
        return 1.0 + w.to(self.model_dtype).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernels is not None:
            return rms_norm_cpu(self.cpu_kernels, x, self.weight, self.eps)
        if self.triton_layers is not None:
            return self.fused(x)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight).to(x.dtype)

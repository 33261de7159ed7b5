"""The one place that picks device, default dtype and collective backend.

CUDA gets bf16-capable defaults and NCCL; CPU gets float32 and gloo. Everything else asks
this module instead of hard-coding "cpu" or "gloo".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Platform:
    device_type: str  # "cuda" | "cpu"

    @staticmethod
    def detect(device: str | None = None) -> Platform:
        if device in (None, "auto"):
            return Platform("cuda" if torch.cuda.is_available() else "cpu")
        if device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'auto', 'cuda' or 'cpu', got {device!r}")
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' requested but CUDA is not available")
        return Platform(device)

    @property
    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    @property
    def dist_backend(self) -> str:
        return "nccl" if self.is_cuda else "gloo"

    def torch_device(self, local_index: int = 0) -> torch.device:
        return torch.device("cuda", local_index) if self.is_cuda else torch.device("cpu")

    def resolve_dtype(self, dtype: str | torch.dtype, checkpoint_dtype: torch.dtype) -> torch.dtype:
        """`auto`: the checkpoint's dtype on CUDA (fp32 checkpoints run as bf16); fp32 on CPU."""
        if isinstance(dtype, torch.dtype):
            return dtype
        if dtype == "auto":
            if not self.is_cuda:
                return torch.float32
            return torch.bfloat16 if checkpoint_dtype == torch.float32 else checkpoint_dtype
        table = {
            "float32": torch.float32,
            "fp32": torch.float32,
            "float": torch.float32,
            "bfloat16": torch.bfloat16,
            "bf16": torch.bfloat16,
            "float16": torch.float16,
            "fp16": torch.float16,
            "half": torch.float16,
        }
        if dtype not in table:
            raise ValueError(f"dtype must be one of auto, {', '.join(table)}; got {dtype!r}")
        return table[dtype]

"""Which attention backend a worker runs, chosen once at its start (EngineArgs.attention_backend).

- "torch": workers/device/layers/attention.py on torch's ops (and, on CPU in float32, the C
  kernels where they are on, as before);
- "triton": workers/device/layers/triton_attention.py, one kernel launch per layer for the
  step's attention and one for its K/V store, K/V read in place through the block tables.
  CUDA only; on CPU only under Triton's interpreter (TRITON_INTERPRET=1, for tests);
- "auto": torch, for now. The triton kernels are tested against torch's attention under
  Triton's interpreter on CPU, but have not yet run on a GPU: until a device run of
  tests/gpu/check.sh passes parity on them, CUDA users opt in with "triton" (a backend that
  is fast and wrong is worse than none). That run flips `AUTO_PICKS_TRITON`.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from workers.config import ATTENTION_BACKENDS as BACKENDS

# Whether "auto" picks triton on CUDA: off until the kernels have passed parity on a GPU.
AUTO_PICKS_TRITON = False


@dataclass(frozen=True)
class AttentionBackend:
    name: str  # "triton" or "torch"
    reason: str  # why, for the start-up log line

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"

    @staticmethod
    def choose(requested: str, device_type: str) -> AttentionBackend:
        if requested not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {BACKENDS}, got {requested!r}")
        has_triton = importlib.util.find_spec("triton") is not None
        if requested == "torch":
            return AttentionBackend("torch", "asked for")
        if requested == "auto":
            if device_type != "cuda":
                return AttentionBackend(
                    "torch", f"auto: triton kernels run on CUDA, not {device_type}"
                )
            if not has_triton:
                return AttentionBackend("torch", "auto: triton is not installed")
            if not AUTO_PICKS_TRITON:
                return AttentionBackend(
                    "torch", "auto: the triton kernels are not yet validated on a GPU"
                )
            return AttentionBackend("triton", "auto: CUDA with triton")
        if not has_triton:
            raise ValueError(
                "attention_backend 'triton' needs the triton package (pip install triton)"
            )
        if device_type != "cuda":
            # Read here, at the worker's start, not at import.
            if os.environ.get("TRITON_INTERPRET") != "1":
                raise ValueError(
                    f"attention_backend 'triton' runs on CUDA; on {device_type} only under "
                    "Triton's interpreter (TRITON_INTERPRET=1, for tests)"
                )
            return AttentionBackend("triton", f"asked for; Triton's interpreter on {device_type}")
        return AttentionBackend("triton", "asked for")

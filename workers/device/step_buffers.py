"""A step's integer inputs in one persistent buffer, uploaded to the device with one copy.

The model runner writes every integer array a step needs (token ids, positions, KV slots,
the attention kernels' tables, the logits rows) into consecutive pieces of one host buffer
and copies the used prefix to one device buffer; the step's tensors are views of it. Both
buffers are allocated once per worker, so a step allocates nothing on the device, moves its
metadata with one copy instead of one per tensor, and the views sit at fixed addresses:
whole-step CUDA graphs (workers/device/decode_graphs.py) read the same views their capture
saw.

On CUDA the host buffer is pinned and the copy non-blocking; an event recorded after it
is waited on before the host buffer is written again (normally long done: the previous
step's results were read back in between). On CPU the two buffers are one: nothing is copied.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

log = logging.getLogger(__name__)


class StepBuffers:
    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        self.device = device
        cuda = device.type == "cuda"
        self.host = torch.zeros(capacity, dtype=torch.int64, pin_memory=cuda)
        self.host_np = self.host.numpy()
        self.dev = torch.zeros(capacity, dtype=torch.int64, device=device) if cuda else self.host
        self._copied: torch.cuda.Event | None = None
        self._shapes: list[tuple[int, ...]] = []
        self._used = 0
        self.uploads = 0  # steps uploaded (one copy each on CUDA)

    def host_views(self, shapes: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
        """Host arrays of these shapes, consecutive from the buffer's start, for the step to
        fill in place (what they held before is stale: write every entry that is read).
        Waits until the last upload has left the buffer."""
        sizes = [int(np.prod(s)) for s in shapes]
        total = sum(sizes)
        if total > self.capacity:
            raise ValueError(
                f"a step needs {total} integers of metadata, more than the {self.capacity} "
                "the worker sized its step buffers for (max_num_batched_tokens, max_num_seqs, "
                "max_model_len)"
            )
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        self._shapes, self._used = list(shapes), total
        return _views(self.host_np, shapes, sizes)

    def upload(self) -> list[torch.Tensor]:
        """Copies what `host_views` laid out to the device (one copy); returns the device views
        of the same shapes."""
        self.uploads += 1
        if self.dev is not self.host:
            self.dev[: self._used].copy_(self.host[: self._used], non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        return self.device_views(self._shapes)

    def device_views(self, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
        """The device buffer's views of these shapes, consecutive from its start: where a
        layout's tensors are, uploaded or not."""
        return _views(self.dev, shapes, [int(np.prod(s)) for s in shapes])


def _views(buf, shapes, sizes):  # noqa: ANN001, ANN202 - numpy or torch alike
    out = []
    o = 0
    for shape, n in zip(shapes, sizes, strict=True):
        out.append(buf[o : o + n].reshape(shape))
        o += n
    return out

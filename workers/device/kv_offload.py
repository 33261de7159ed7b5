"""One rank's host KV pool: its shard of every block the host tier holds, by block hash.

The engine's bookkeeping (workers/core/host_tier.py) decides what is saved, loaded and
dropped; each step carries those copies (`KvTransfers`) to every rank, which applies them to
its own shard before the forward, in the order the bookkeeping assumes: saves, loads, drops.

On CUDA the pool is pinned host memory and the copies run non-blocking on a stream of their
own: it first waits for the work queued so far (a saved block holds what earlier steps
wrote), and the forward's stream waits for it (the forward overwrites saved blocks and reads
loaded ones). Elsewhere the pool is plain tensors and the copies are synchronous.
"""

from __future__ import annotations

import torch

from workers.messages.step import KvTransfers


class KvOffload:
    def __init__(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device
    ) -> None:
        self.kv_caches = kv_caches
        self.device = device
        self.pool: dict[int, torch.Tensor] = {}  # hash -> [layers, 2 (K, V), *block shape]
        cuda = device.type == "cuda"
        self.pin = cuda
        self.stream = torch.cuda.Stream(device) if cuda else None

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.pool.values())

    def apply(self, transfers: KvTransfers) -> None:
        """Makes the step's copies; the forward queued after this sees their results."""
        if self.stream is None:
            self._copy(transfers)
            return
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            self._copy(transfers)
        compute.wait_stream(self.stream)

    @torch.inference_mode()
    def _copy(self, t: KvTransfers) -> None:
        if t.saves:
            ids = self._ids([b for _, b in t.saves])
            # [blocks, layers, 2, *block shape]: one gather per layer and tensor.
            gathered = torch.stack(
                [
                    torch.stack((k.index_select(0, ids), v.index_select(0, ids)), 1)
                    for k, v in self.kv_caches
                ],
                1,
            )
            for j, (h, _) in enumerate(t.saves):
                host = torch.empty(
                    gathered.shape[1:], dtype=gathered.dtype, device="cpu", pin_memory=self.pin
                )
                host.copy_(gathered[j], non_blocking=self.pin)
                self.pool[h] = host  # a hash saved again holds the same contents
        if t.loads:
            ids = self._ids([b for _, b in t.loads])
            staged = torch.stack(
                [self.pool[h].to(self.device, non_blocking=self.pin) for h, _ in t.loads]
            )
            for layer, (k, v) in enumerate(self.kv_caches):
                k.index_copy_(0, ids, staged[:, layer, 0])
                v.index_copy_(0, ids, staged[:, layer, 1])
        for h in t.drops:
            self.pool.pop(h, None)

    def _ids(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.long, device=self.device)

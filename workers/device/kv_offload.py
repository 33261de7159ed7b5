"""One rank's host KV pool: its shard of every block the host tier holds, by block hash.

The engine's bookkeeping (workers/core/host_tier.py) decides what is saved, loaded and
dropped; each step carries those copies (`KvTransfers`) to every rank, which applies them to
its own shard before the forward, in the order the bookkeeping assumes: saves, loads, drops.

On CUDA the pool is pinned host memory and the copies run non-blocking on a stream of their
own: it first waits for the work queued so far (a saved block holds what earlier steps
wrote), and the forward's stream waits for it (the forward overwrites saved blocks and reads
loaded ones). Elsewhere the pool is plain tensors and the copies are synchronous.

The cluster tier adds two kinds of copy: exports (device blocks copied out for another
replica, kept until the executor takes them with `take_exports`) and imports (blocks another
replica exported, this rank's shard put into the pool). Both travel as raw bytes (uint8
numpy arrays): numpy has no bfloat16, and Ray's object store hands numpy out without a copy.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from workers.messages.step import KvTransfers


class KvOffload:
    def __init__(
        self,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        device: torch.device,
        rank: int = 0,
    ) -> None:
        self.kv_caches = kv_caches
        self.rank = rank
        self.device = device
        self.pool: dict[int, torch.Tensor] = {}  # hash -> [layers, 2 (K, V), *block shape]
        cuda = device.type == "cuda"
        self.pin = cuda
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.exports: dict[int, torch.Tensor] = {}  # hash -> block copied out, not yet taken
        # One block on this rank: [layers, 2 (K, V), *block shape] of the cache's dtype.
        k0 = kv_caches[0][0]
        self.block_shape = (len(kv_caches), 2, *k0.shape[1:])
        self.dtype = k0.dtype
        self.block_bytes = k0[0].numel() * k0.element_size() * 2 * len(kv_caches)

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

    def take_exports(self, hashes: list[int]) -> dict[int, np.ndarray]:
        """The exported blocks among `hashes`, as raw bytes, once their copies are done."""
        if self.stream is not None:
            self.stream.synchronize()
        out = {}
        for h in hashes:
            if (t := self.exports.pop(h, None)) is not None:
                out[h] = t.view(torch.uint8).reshape(-1).numpy()
        return out

    @torch.inference_mode()
    def _copy(self, t: KvTransfers) -> None:
        for pairs, into in ((t.saves, self.pool), (t.exports, self.exports)):
            if pairs:
                self._copy_out(pairs, into)
        for h, shards in t.imports:
            self._import(h, shards)
        if t.loads:
            ids = self._ids([b for _, b in t.loads])
            staged = torch.stack(
                [self.pool[h].to(self.device, non_blocking=self.pin) for h, _ in t.loads]
            )
            raw = _raw(staged)
            for layer, (k, v) in enumerate(self.kv_caches):
                _raw(k).index_copy_(0, ids, raw[:, layer, 0])
                _raw(v).index_copy_(0, ids, raw[:, layer, 1])
        for h in t.drops:
            self.pool.pop(h, None)

    def _copy_out(self, pairs: list[tuple[int, int]], into: dict[int, torch.Tensor]) -> None:
        ids = self._ids([b for _, b in pairs])
        # [blocks, layers, 2, *block shape]: one gather per layer and tensor.
        gathered = torch.stack(
            [
                torch.stack((k.index_select(0, ids), v.index_select(0, ids)), 1)
                for k, v in self.kv_caches
            ],
            1,
        )
        for j, (h, _) in enumerate(pairs):
            host = torch.empty(
                gathered.shape[1:], dtype=gathered.dtype, device="cpu", pin_memory=self.pin
            )
            host.copy_(gathered[j], non_blocking=self.pin)
            into[h] = host  # a hash copied again holds the same contents

    def _import(self, block_hash: int, shards: tuple[np.ndarray, ...]) -> None:
        shard = shards[self.rank]
        if shard.nbytes != self.block_bytes:  # the core checked: a mismatch is a bug
            raise ValueError(f"a pulled KV block has {shard.nbytes} bytes, not {self.block_bytes}")
        host = torch.empty(self.block_shape, dtype=self.dtype, device="cpu", pin_memory=self.pin)
        with warnings.catch_warnings():  # Ray's arrays are read-only; this only reads them
            warnings.simplefilter("ignore", UserWarning)
            src = torch.from_numpy(shard)
        host.view(torch.uint8).view(-1).copy_(src)
        self.pool[block_hash] = host

    def _ids(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.long, device=self.device)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """An FP8 cache's bytes (torch's index_copy_ has no float8 kernel on CPU); others as they
    are."""
    return t.view(torch.uint8) if t.element_size() == 1 else t

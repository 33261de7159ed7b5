"""Shared by the kernel tests: a library reporting another vector width, a toy model, batch
states."""

from __future__ import annotations

import torch

BLOCK = 16


class Width:
    """The real library, reporting vectors of `bytes` (32: an AVX2 build, 64: AVX-512)."""

    def __init__(self, lib, bytes: int) -> None:  # noqa: A002
        self._lib, self._bytes = lib, bytes

    def kvray_vector_bytes(self) -> int:
        return self._bytes

    def __getattr__(self, name: str):
        return getattr(self._lib, name)


def toy_model(bf16: bool) -> torch.nn.Module:
    """A column-parallel linear, and an LM head tied to an embedding (they share a weight)."""
    from workers.device.distributed import TPGroup
    from workers.device.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from workers.device.layers.linear import ColumnParallelLinear

    tp, f32 = TPGroup(), torch.float32
    model = torch.nn.Module()
    model.proj = ColumnParallelLinear(32, [48, 16], True, tp, f32)
    model.embed = VocabParallelEmbedding(100, 32, tp, f32)
    model.head = ParallelLMHead(model.embed, 100, 32, tp, f32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape).bfloat16().float() if bf16 else torch.randn(p.shape))
    return model


def state(name: str, length: int, computed: int, scheduled: int, blocks: list[int]):
    from workers.device.model_runner import SeqState
    from workers.sampling_params import SamplingParams

    s = SeqState(name, length, list(range(length)), SamplingParams(), blocks)
    s.num_computed_tokens, s.num_scheduled = computed, scheduled
    return s

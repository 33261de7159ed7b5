"""Vocab-parallel embedding and LM head: each rank owns a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
from torch import nn

from workers.device.distributed import TPGroup
from workers.device.layers.linear import linear


def padded_vocab(vocab_size: int, tp: TPGroup) -> int:
    # Pad so every rank owns the same number of rows; padded rows are never emitted.
    return -(-vocab_size // tp.size) * tp.size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.per_rank = padded_vocab(vocab_size, tp) // tp.size
        self.start = tp.rank * self.per_rank
        self.weight = nn.Parameter(
            torch.zeros(self.per_rank, hidden, dtype=dtype), requires_grad=False
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return nn.functional.embedding(ids, self.weight)
        local = ids - self.start
        mask = (local < 0) | (local >= self.per_rank)
        out = nn.functional.embedding(local.masked_fill(mask, 0), self.weight)
        out.masked_fill_(mask.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Module):
    """Logits for the selected positions; gathered so every rank sees the full vocabulary."""

    def __init__(
        self,
        embedding: VocabParallelEmbedding | None,
        vocab_size: int,
        hidden: int,
        tp: TPGroup,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        if embedding is not None:  # tied
            self.weight = embedding.weight
        else:
            per_rank = padded_vocab(vocab_size, tp) // tp.size
            self.weight = nn.Parameter(
                torch.zeros(per_rank, hidden, dtype=dtype), requires_grad=False
            )
        self.cpu_kernels: int | None = None  # set by cpu_kernels.use_cpu_kernels
        self.packed_weight: torch.Tensor | None = None  # likewise, for bfloat16 weights

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight, None, self.cpu_kernels, self.packed_weight)
        logits = self.tp.all_gather_last_dim(logits)
        return logits[..., : self.vocab_size]

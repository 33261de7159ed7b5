"""The triton backend's experts (grouped GEMMs, no host sync) against the torch path's
`SparseMoeBlock.experts`, on CPU under Triton's interpreter: uneven routing, experts with no
token, one expert with every token, and expert parallelism's partial sums."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from tests.triton_interpret import interpreted_kernels
from workers.device.distributed import TPGroup
from workers.device.layers.moe import SparseMoeBlock
from workers.moe_config import MoeConfig

H, INTER, E = 32, 24, 6


@pytest.fixture(scope="module")
def kernels() -> Iterator[ModuleType]:
    yield from interpreted_kernels("workers.device.layers.triton_moe", "_grouped_linear_kernel")


def _block(top_k: int, rank: int = 0, size: int = 1, ep: bool = False) -> SparseMoeBlock:
    moe = MoeConfig(
        num_experts=E,
        top_k=top_k,
        intermediate_size=INTER,
        renormalize=True,
        weights_in_model_dtype=False,
        sparse_layers=(0,),
        expert_parallel=ep,
    )
    block = SparseMoeBlock(H, moe, TPGroup(rank, size), torch.float32)
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return block


def _routing(t: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weights, ids = torch.randn(t, E, generator=g).softmax(-1).topk(top_k, dim=-1)
    return weights, ids


@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_matches_the_torch_experts(kernels: ModuleType, top_k: int, tokens: int) -> None:
    block = _block(top_k)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(1))
    weights, ids = _routing(tokens, top_k, seed=tokens)
    got = kernels.moe_experts(x, weights, ids, block.w13, block.w2, 0)
    torch.testing.assert_close(got, block.experts(x, weights, ids), atol=1e-6, rtol=1e-5)


def test_one_expert_with_every_token_and_others_with_none(kernels: ModuleType) -> None:
    block = _block(2)
    x = torch.randn(33, H, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([[4, 1]] * 33)  # expert 4 and 1 take all 33 tokens: 3 row blocks each
    weights = torch.full((33, 2), 0.5)
    got = kernels.moe_experts(x, weights, ids, block.w13, block.w2, 0)
    torch.testing.assert_close(got, block.experts(x, weights, ids), atol=1e-6, rtol=1e-5)


def test_expert_parallel_ranks_add_up_to_the_whole(kernels: ModuleType) -> None:
    whole = _block(2)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(3))
    weights, ids = _routing(9, 2, seed=5)
    total = torch.zeros(9, H)
    for rank in range(2):
        part = _block(2, rank, 2, ep=True)
        first, n = part.partition.first_expert, part.partition.num_local_experts
        with torch.no_grad():
            part.w13.copy_(whole.w13[first : first + n])
            part.w2.copy_(whole.w2[first : first + n])
        got = kernels.moe_experts(x, weights, ids, part.w13, part.w2, first)
        torch.testing.assert_close(got, part.experts(x, weights, ids), atol=1e-6, rtol=1e-5)
        total += got
    torch.testing.assert_close(total, whole.experts(x, weights, ids), atol=1e-5, rtol=1e-5)

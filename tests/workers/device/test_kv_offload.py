"""A rank's host KV pool: saves, loads and drops applied to a real KV-cache layout, on the
CPU here (and on CUDA where one is present: pinned pool, its own stream)."""

from __future__ import annotations

import pytest
import torch

from workers.device.kv_offload import KvOffload
from workers.kv_layout import kv_block_bytes
from workers.messages.step import KvTransfers

LAYERS, BLOCKS, BS, HEADS, DIM = 3, 6, 4, 2, 8
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _caches(device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (BLOCKS, BS, HEADS, DIM)
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(shape, generator=g).to(device), torch.randn(shape, generator=g).to(device))
        for _ in range(LAYERS)
    ]


def _block(kv: list[tuple[torch.Tensor, torch.Tensor]], b: int) -> list[torch.Tensor]:
    return [t[b].cpu().clone() for pair in kv for t in pair]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("device", DEVICES)
def test_save_then_load_restores_every_layer(device: str) -> None:
    kv = _caches(device)
    pool = KvOffload(kv, torch.device(device))
    before = {b: _block(kv, b) for b in (1, 4)}
    pool.apply(KvTransfers(saves=[(11, 1), (44, 4)]))
    assert pool.pool.keys() == {11, 44}
    assert pool.num_bytes == 2 * LAYERS * 2 * BS * HEADS * DIM * 4
    assert pool.pool[11].device.type == "cpu"
    assert pool.pool[11].is_pinned() == (device == "cuda")
    for k, v in kv:  # the forward reuses the blocks
        k.zero_()
        v.zero_()
    # Block 4's contents into block 0 and block 1's back into block 1; the pool keeps them.
    pool.apply(KvTransfers(loads=[(44, 0), (11, 1)]))
    if device == "cuda":
        torch.cuda.synchronize()
    assert _same(_block(kv, 0), before[4]) and _same(_block(kv, 1), before[1])
    assert _same(_block(kv, 2), [torch.zeros(BS, HEADS, DIM)] * (2 * LAYERS))  # untouched
    assert pool.pool.keys() == {11, 44}


@pytest.mark.parametrize("device", DEVICES)
def test_one_step_saves_before_it_loads_then_drops(device: str) -> None:
    """Block 2 is evicted (saved) and gets another block's contents back in the same step;
    the save reads it first. A dropped hash leaves the pool."""
    kv = _caches(device)
    pool = KvOffload(kv, torch.device(device))
    old2, old3 = _block(kv, 2), _block(kv, 3)
    pool.apply(KvTransfers(saves=[(30, 3), (50, 5)]))
    pool.apply(KvTransfers(saves=[(20, 2)], loads=[(30, 2)], drops=[50]))
    if device == "cuda":
        torch.cuda.synchronize()
    assert pool.pool.keys() == {20, 30}
    assert _same(_block(kv, 2), old3)
    assert _same([t.cpu() for t in pool.pool[20].flatten(0, 1)], old2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("tp", [1, 2])
def test_config_block_bytes_match_the_cache_tensors(demo_dir, dtype: str, tp: int) -> None:  # noqa: ANN001
    """The engine sizes the tier without torch (workers.kv_layout.kv_block_bytes): the same bytes
    as a block of the cache tensors a rank allocates."""
    from workers.config import EngineArgs

    config = EngineArgs(model=str(demo_dir), dtype=dtype).create_config()
    m = config.model
    block = torch.empty(
        (2, m.num_layers, config.cache.block_size, m.kv_heads_per_rank(tp), m.head_dim),
        dtype=config.torch_dtype,
    )
    assert kv_block_bytes(config, tp) == block.numel() * block.element_size()

"""kvray's GGML block decoders (workers/gguf/dequant.py) against gguf-py's reference
dequantizer, bit for bit, on random blocks: every bit pattern of the quantized values and the
packed scales, finite float16 scales."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from workers.gguf.dequant import FORMATS, dequantize, q8_0_int8

QUANTIZED = [f for f in FORMATS.values() if f.block > 1]
# Where each block type keeps its float16 scales (d, and Q4_K's dmin), in bytes.
_SCALES = {"Q8_0": (0,), "Q4_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}


def _random_blocks(name: str, n: int, rng: np.random.Generator) -> np.ndarray:
    fmt = next(f for f in FORMATS.values() if f.name == name)
    blocks = rng.integers(0, 256, (n, fmt.nbytes), dtype=np.uint8)
    for at in _SCALES[name]:
        scale = rng.uniform(-0.1, 0.1, n).astype(np.float16)
        blocks[:, at : at + 2] = scale.view(np.uint8).reshape(n, 2)
    return blocks


def _ggml_type(name: str) -> gguf.GGMLQuantizationType:
    return getattr(gguf.GGMLQuantizationType, name)


@pytest.mark.parametrize("fmt", QUANTIZED, ids=lambda f: f.name)
def test_block_types_decode_as_gguf_py_does(fmt) -> None:  # noqa: ANN001
    rng = np.random.default_rng(0)
    rows, cols = 6, 2 * 256
    blocks = _random_blocks(fmt.name, rows * cols // fmt.block, rng)
    want = gguf.quants.dequantize(blocks.reshape(rows, -1), _ggml_type(fmt.name))
    got = dequantize(torch.from_numpy(blocks.reshape(-1).copy()), fmt, (rows, cols))
    assert got.dtype == torch.float32 and got.shape == (rows, cols)
    assert np.array_equal(got.numpy(), want)  # bit for bit: the same float32 operations


@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
def test_float_types_keep_their_dtype_and_values(name: str) -> None:
    fmt = next(f for f in FORMATS.values() if f.name == name)
    w = np.random.default_rng(1).normal(0, 1, (3, 64)).astype(np.float32)
    stored = gguf.quants.quantize(w, _ggml_type(name)) if name != "F32" else w
    raw = torch.from_numpy(np.ascontiguousarray(stored).reshape(-1).view(np.uint8).copy())
    got = dequantize(raw, fmt, (3, 64))
    want = gguf.quants.dequantize(stored, _ggml_type(name))
    assert got.dtype == {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[name]
    assert np.array_equal(got.float().numpy(), want)


def test_q8_0_splits_into_int8_and_a_scale_per_32_columns() -> None:
    rows, cols = 4, 96
    w = np.random.default_rng(2).normal(0, 0.1, (rows, cols)).astype(np.float32)
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    raw = torch.from_numpy(blocks.reshape(-1).copy())
    q, scale = q8_0_int8(raw, rows, cols)
    assert (q.dtype, q.shape, scale.dtype, scale.shape) == (
        torch.int8,
        (rows, cols),
        torch.float32,
        (rows, cols // 32),
    )
    product = q.float() * scale.repeat_interleave(32, dim=1)
    want = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(product.numpy(), want)


def test_bytes_that_are_not_whole_blocks_are_refused() -> None:
    fmt = next(f for f in FORMATS.values() if f.name == "Q4_K")
    with pytest.raises(ValueError, match="not whole Q4_K blocks"):
        dequantize(torch.zeros(fmt.nbytes + 1, dtype=torch.uint8), fmt, (1, 256))

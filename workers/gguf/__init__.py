"""GGUF files (llama.cpp's single-file checkpoints) served as kvray models: `--model x.gguf`.

- metadata.py: the file's key/values and tensor table (read through gguf-py's reader,
  memory-mapped: no tensor bytes are read until a tensor is converted).
- config.py: the architecture's metadata as the config.json kvray reads (workers/config.py),
  and which quantization the weights take in memory.
- dequant.py: GGML block formats (Q8_0, Q4_0, Q4_K, Q6_K) and floats into torch tensors.
- int4.py: Q4_0 and Q4_K projections as the int4 W4A16 layer's packed words, scales and (Q4_K)
  float offsets, kept 4-bit.
- tensors.py: GGUF tensor names to the checkpoint names the loader knows
  (workers/device/loader.py), Llama's Q/K rows un-permuted, Q8_0 kept int8 and Q4_0 / Q4_K
  4-bit where they can.
- rope.py: Llama 3.1+'s llama3 rope scaling read back from its per-frequency factors.
- tokenizer.py: the tokenizer the file embeds (transformers' GGUF converter).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workers.config import ModelConfig

GGUF_SUFFIX = ".gguf"


def is_gguf(path: str | Path) -> bool:
    """A model path naming a .gguf file (a directory is a Hugging Face checkpoint)."""
    return str(path).lower().endswith(GGUF_SUFFIX) and not Path(path).is_dir()


def gguf_tensors(c: ModelConfig) -> Iterator[tuple[str, Any]]:
    """The loader's (checkpoint name, lazy tensor) pairs of GGUF file `c.path`
    (workers/gguf/tensors.py; imported on use: it needs torch and numpy, this module not)."""
    from workers.gguf.tensors import gguf_tensors as tensors

    return tensors(c)

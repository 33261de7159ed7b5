"""The tokenizer a GGUF file embeds (`tokenizer.ggml.*`: vocabulary, merges or scores, special
token ids, chat template), built by transformers' GGUF tokenizer converter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workers.gguf.config import NO_TOKENIZER
from workers.gguf.metadata import field, open_gguf


def gguf_tokenizer(path: Path) -> Any:
    """transformers' fast tokenizer of GGUF file `path`; ValueError when it embeds none."""
    from transformers import AutoTokenizer

    if field(open_gguf(path), "tokenizer.ggml.tokens", None) is None:
        raise ValueError(NO_TOKENIZER.format(path=path))
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)

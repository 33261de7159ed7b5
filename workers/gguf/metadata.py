"""A GGUF file's key/values and tensor table, read through gguf-py's reader.

The reader memory-maps the file: opening it parses only the header, and a tensor's bytes are
read when it is converted (workers/gguf/tensors.py), one at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_MISSING = object()


def open_gguf(path: str | Path) -> Any:
    """gguf-py's GGUFReader over `path`; ValueError naming the file when it is not GGUF."""
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    try:
        return GGUFReader(path, "r")
    except (ValueError, OSError) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from None


def field(reader: Any, key: str, default: Any = _MISSING) -> Any:
    """The value of metadata `key`: an int, float, bool, str, or a list of them; `default`
    when absent (ValueError naming the key when there is none)."""
    f = reader.fields.get(key)
    if f is None:
        if default is _MISSING:
            raise ValueError(f"GGUF metadata has no {key!r}")
        return default
    return f.contents()


def tensor_shape(tensor: Any) -> tuple[int, ...]:
    """A tensor's shape rows first, as torch and safetensors write it (GGUF lists its
    dimensions innermost first: ne0 is the number of columns)."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def type_name(type_id: int) -> str:
    """GGML's name for a tensor type id (Q4_K, IQ2_XS, ...), for messages."""
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"unknown type {type_id}"

"""Sizes as people write them ('2GiB', '512MiB', bytes): parsed for the CLI and the benchmarks."""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?B?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'1073741824', '1GiB', '512MiB', '2G', '1.5GB' -> bytes (K/M/G/T read as powers of 1024)."""
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"not a memory size: {text!r} (e.g. 512MiB, 2GiB, 1073741824)")
    number, unit = float(match.group(1)), match.group(2).upper()
    return int(number * 1024 ** "_KMGT".index(unit or "_"))

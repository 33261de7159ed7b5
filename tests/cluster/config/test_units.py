"""parse_size: memory sizes as people write them."""

from __future__ import annotations

import pytest

from cluster.config.units import parse_size


def test_parse_size() -> None:
    assert parse_size("1073741824") == 1 << 30
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("1.5G") == 3 << 29
    with pytest.raises(ValueError, match="memory size"):
        parse_size("lots")

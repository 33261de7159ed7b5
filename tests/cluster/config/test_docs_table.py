"""docs/contracts.md's settings table is what the declarations give."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import ServeConfig
from cluster.config.docs_table import BEGIN, END, settings_table, with_table

CONTRACTS = Path(__file__).resolve().parents[3] / "docs" / "contracts.md"


def test_the_docs_table_is_the_declarations() -> None:
    text = CONTRACTS.read_text()
    assert with_table(text) == text, (
        "docs/contracts.md's settings table is stale: "
        "python -m cluster.config.docs_table docs/contracts.md"
    )


def test_every_setting_has_a_row_with_its_flag_key_and_help() -> None:
    rows = settings_table().splitlines()
    for _, f, s in ServeConfig.settings():
        (row,) = [r for r in rows if f"| `{f.name}` |" in r]
        assert row.startswith(f"| `{s.flag(f.name)}`") and s.help.replace("|", "\\|") in row
    table = "\n".join(rows)
    assert "| `--tensor-parallel-size`, `--tp` | `tensor_parallel_size` | 1 |" in table
    assert "| `--max-request-body-bytes` | `max_request_body_bytes` | 8 MiB |" in table


def test_a_page_without_the_markers_is_an_error() -> None:
    with pytest.raises(ValueError, match="settings table"):
        with_table("no table here")
    assert with_table(f"a\n{BEGIN}\nold\n{END}\nb").startswith(f"a\n{BEGIN}\n| flag |")

"""`kvray bench kernels`: the CPU kernels against torch's ops, on the demo model's shapes."""

from __future__ import annotations

import pytest

from cluster.cli.main import main
from workers.layers.cpu_kernels import kernel


@pytest.mark.skipif(kernel() is None, reason="no C compiler: the kernels are unavailable")
def test_prints_one_row_per_step_size(capsys):
    assert main(["bench", "kernels", "--rows", "1", "6", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "4 layers, hidden 256, heads 4/2 x 64" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "6"]
    # rows, then torch / kernel ratio for linear, attention and the small ops
    assert all(len(r) == 13 and r[4].endswith("x") for r in rows), rows


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rows", "0"], "must be positive"),
        (["--model", "random:qwen3-7t"], "unknown random model"),
        (["--model", "/no/such/checkpoint"], "not a checkpoint with a readable config.json"),
    ],
)
def test_bad_flags_are_named(argv, message):
    with pytest.raises(SystemExit, match=message):
        main(["bench", "kernels", *argv])

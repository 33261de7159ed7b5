"""`kvray bench kernels`: the CPU kernels against torch's ops, on the demo model's shapes."""

from __future__ import annotations

import pytest

from cluster.cli.main import main
from workers.device.layers.cpu_kernels import amx, kernel


@pytest.mark.skipif(kernel() is None, reason="no C compiler: the kernels are unavailable")
def test_prints_one_row_per_step_size_and_chunk_length(capsys):
    argv = ["--rows", "1", "6", "--chunk-lens", "20", "130", "--prefix", "9", "--repeats", "1"]
    assert main(["bench", "kernels", *argv]) == 0
    out = capsys.readouterr().out
    assert "4 layers, hidden 256, heads 4/2 x 64" in out
    steps, chunks = out.split("prefill attention of one chunk over 9 cached tokens")
    rows = [line.split() for line in steps.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "6"]
    # rows, then torch / kernel ratio for linear (skinny, bfloat16 weights, and on the AMX
    # tiles where the CPU has them), attention and the small ops
    cells = 5 if amx(kernel()) else 4  # each "torch / kernel ratio", four words
    assert all(len(r) == 1 + 4 * cells for r in rows), rows
    assert all(r[4 * i].endswith("x") for r in rows for i in range(1, cells + 1)), rows
    rows = [line.split() for line in chunks.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["20", "130"]
    # chunk length, SDPA, then each kernel with SDPA / kernel
    assert all(len(r) == 6 and r[3].endswith("x") and r[5].endswith("x") for r in rows), rows


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rows", "0"], "must be positive"),
        (["--chunk-lens", "0"], "--chunk-lens must be positive"),
        (["--prefix", "-1"], "--prefix at least 0"),
        (["--model", "random:qwen3-7t"], "unknown random model"),
        (["--model", "/no/such/checkpoint"], "not a checkpoint with a readable config.json"),
    ],
)
def test_bad_flags_are_named(argv, message):
    with pytest.raises(SystemExit, match=message):
        main(["bench", "kernels", *argv])

"""`kvray bench step`: one engine step's time, ops and memory-bandwidth share, on the demo."""

from __future__ import annotations

import json

import pytest
import torch

from cluster.bench.step.probes import count_ops
from cluster.cli.main import main

ROW_KEYS = {
    "case",
    "batch",
    "tokens",
    "context",
    "step_ms",
    "execute_ms",
    "device_ms",
    "step_ms_median",
    "execute_ms_median",
    "device_ms_median",
    "ops",
    "ops_per_layer",
    "ops_by_name",
    "layers",
    "weight_bytes",
    "kv_bytes",
    "bytes_read",
    "bytes_per_s",
    "copy_bytes_per_s",
    "roofline_share",
}


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    path = tmp_path_factory.mktemp("step") / "step.json"
    argv = ["--batch-sizes", "1,2", "--context", "32", "--prefill-tokens", "64", "--steps", "2"]
    argv += ["--warmup", "1", "--prefill-steps", "2", "--device", "cpu", "--dtype", "float32"]
    assert main(["bench", "step", *argv, "--result-json", str(path)]) == 0
    return json.loads(path.read_text())


def test_every_case_is_a_row(result):
    rows = result["rows"]
    assert [(r["case"], r["batch"], r["tokens"]) for r in rows] == [
        ("decode", 1, 1),
        ("decode", 2, 2),
        ("prefill", 1, 64),
    ]
    assert all(ROW_KEYS <= r.keys() for r in rows), [ROW_KEYS - r.keys() for r in rows]
    decode = rows[:2]
    # Prompts of 32 tokens, then decoding: every timed step attends more than the prompt.
    assert all(32 < r["context"] < 64 for r in decode), [r["context"] for r in decode]
    assert all(len(r["step_ms"]) == len(r["device_ms"]) == 2 for r in decode)
    assert len(rows[2]["step_ms"]) == 2


def test_ops_bytes_and_bandwidth(result):
    layers = result["layers"]
    assert layers == 4  # the demo checkpoint
    for r in result["rows"]:
        assert r["ops"] > 0 and sum(r["ops_by_name"].values()) <= r["ops"]
        assert r["ops_per_layer"] == pytest.approx(r["ops"] / layers)
        assert r["weight_bytes"] > 0 and r["kv_bytes"] > 0
        assert r["bytes_read"] == pytest.approx(r["weight_bytes"] + r["kv_bytes"])
        assert r["bytes_per_s"] > 0 and r["roofline_share"] > 0
        assert r["bytes_per_s"] == pytest.approx(r["bytes_read"] / (r["device_ms_median"] / 1e3))
    # Two sequences read twice the K/V of one; the weights once either way.
    one, two, _ = result["rows"]
    assert two["kv_bytes"] == pytest.approx(2 * one["kv_bytes"])
    assert two["weight_bytes"] - one["weight_bytes"] < 4096  # one more embedding row at most
    assert result["copy_bytes_per_s"] > 0
    assert result["settings"]["prefill_tokens"] == 64 and result["device"] == "cpu"
    assert {"cpu", "cpu_count", "torch_threads", "torch", "date"} <= result["machine"].keys()


def test_the_demo_run_reports_no_graphs(result):
    assert result["graph_replays"] is None  # eager: nothing was captured


def test_decode_steps_of_the_triton_backends_graphs_are_counted(tmp_path):
    """--attention-backend triton --compile (CPU: Triton's interpreter, tests/conftest.py; the
    padded decode steps run eagerly there, as a graph would replay them)."""
    pytest.importorskip("triton")
    path = tmp_path / "step.json"
    argv = ["--batch-sizes", "1,3", "--context", "8", "--prefill-tokens", "16", "--steps", "2"]
    argv += ["--warmup", "1", "--prefill-steps", "1", "--device", "cpu", "--dtype", "float32"]
    argv += ["--attention-backend", "triton", "--compile", "--no-cpu-kernels"]
    assert main(["bench", "step", *argv, "--result-json", str(path)]) == 0
    result = json.loads(path.read_text())
    # B=1 and B=3 (padded to 4): the warm-up and timed steps, and one counting the ops each.
    assert result["graph_replays"] == 2 * (1 + 2 + 1)


def test_op_counter_counts_a_known_function():
    a, b = torch.ones(4, 4), torch.ones(4, 4)
    ops = count_ops(lambda: torch.relu(torch.mm(a, b) + 1) * 2)
    assert ops == {"aten::mm": 1, "aten::add": 1, "aten::relu": 1, "aten::mul": 1}


def test_help_parses(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "step", "--help"])
    assert exit_info.value.code == 0
    assert "--batch-sizes" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--batch-sizes", "0,2"], "must be positive"),
        (["--steps", "0"], "--steps and --prefill-steps must be positive"),
        (["--model", "random:qwen3-7t"], "unknown random model"),
        (["--model", "/no/such/checkpoint"], "not a checkpoint directory"),
    ],
)
def test_bad_arguments_exit_with_a_message(argv, message):
    with pytest.raises(SystemExit, match=message):
        main(["bench", "step", *argv])

"""`kvray bench throughput --workload json-schema` on a tiny run: well-formed figures, the
same tokens generated constrained and not. No speed is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema

from cluster.bench.throughput.structured import SCHEMAS
from cluster.cli.main import main


def test_json_schema_workload_reports_each_run_and_compile_times(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    argv = ["bench", "throughput", "--workload", "json-schema", "--num-prompts", "8"]
    argv += ["--input-len-range", "4", "12", "--result-json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    runs = result["results"]
    assert set(runs) == {"unconstrained", "constrained", "mixed"}
    tokens = {r["output_tokens"] for r in runs.values()}
    assert len(tokens) == 1 and tokens.pop() > 0  # every run generated the same tokens
    for r in runs.values():
        assert r["seconds"] > 0 and r["output_tok_s"] > 0 and r["ratio_vs_unconstrained"] > 0
    assert runs["unconstrained"]["ratio_vs_unconstrained"] == 1.0
    assert set(result["compile_ms"]) == set(SCHEMAS)
    for times in result["compile_ms"].values():
        assert times["cold"] > 0 and times["cached"] > 0
    assert 0 <= result["constrained_finished"] <= 8


def test_bench_schemas_are_valid_json_schemas() -> None:
    for schema in SCHEMAS.values():
        jsonschema.Draft202012Validator.check_schema(schema)

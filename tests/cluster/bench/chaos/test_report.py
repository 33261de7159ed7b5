"""The report of `kvray bench serve --chaos`: outputs against the offline engine's and their
schemas, the summary's counts, latencies, shares and faults, the migration counter's parsing."""

from __future__ import annotations

import pytest

from cluster.bench.chaos.client import ERROR, LOST, OK, ChaosResult
from cluster.bench.chaos.expected import Expected, changes, schema_problem
from cluster.bench.chaos.faults import Fault
from cluster.bench.chaos.metrics import counter_by_cause, migrations_between
from cluster.bench.chaos.report import chaos_ok, format_chaos, summarize_chaos
from cluster.bench.chaos.workload import ChaosRequest

# -- the report -------------------------------------------------------------------------------


def _result(
    index: int, outcome: str, *, text: str = "abc", tokens: int = 3, ttft: float | None = None,
    priority: int = 0, tenant: int = 0, status: str = "200", schema: str = "",
    finish: str = "length", clear: bool = True, e2e: float = 1.0,
) -> ChaosResult:  # fmt: skip
    req = ChaosRequest(index, "completions", ttft is not None, 3, priority, tenant, seed=None,
                       schema=schema, prompt_ids=(1,))  # fmt: skip
    return ChaosResult(req, sent=10.0, outcome=outcome, status=status, clear=clear, text=text,
                       finish_reason=finish if outcome == OK else None,
                       completion_tokens=tokens if outcome == OK else 0, ttft=ttft,
                       end=10.0 + e2e)  # fmt: skip


def test_outputs_are_compared_with_the_offline_engine_and_schemas() -> None:
    want = Expected("abc", "length", 3)
    assert changes(_result(0, OK), want) == []
    assert changes(_result(0, OK, text="abd"), want) == [
        "text differs from char 2: served 'd', offline 'c'"
    ]
    assert changes(_result(0, OK, tokens=4, finish="stop"), want) == [
        "finish_reason stop, offline length",
        "4 completion tokens, offline 3",
    ]
    doc = '{"name":"a","age":3,"email":"e"}'
    ok = _result(0, OK, text=doc, finish="stop", schema="person")
    assert changes(ok, Expected(doc, "stop", 3)) == []
    bad = '{"name":"a","age":300,"email":"e"}'
    got = changes(
        _result(0, OK, text=bad, finish="stop", schema="person"), Expected(bad, "stop", 3)
    )
    assert len(got) == 1 and got[0].startswith("output does not validate")
    assert schema_problem("{", {}).startswith("not JSON")


def test_the_summary_counts_outcomes_latency_shares_and_faults() -> None:
    results = [
        _result(0, OK, ttft=0.1, priority=-1, tenant=0, tokens=3),
        _result(1, OK, ttft=0.3, priority=-1, tenant=1, tokens=3, e2e=2.0),
        _result(2, OK, priority=5, tenant=1, tokens=3, text="xyz"),  # changed
        _result(3, ERROR, status="503", tenant=0),
        _result(4, ERROR, status="502", clear=False, tenant=0),
        _result(5, LOST, status="connection", tenant=2),
    ]
    expected = {i: Expected("abc", "length", 3) for i in range(3)}
    faults = [
        Fault(5.0, "engine", at_s=5.1, replica="r1", pid=11, pid_gone=True, repaired_s=4.0),
        Fault(6.0, "replica", at_s=6.3, replica="r2", pid=12, pid_gone=True),
        Fault(9.0, "engine", error="no replica could take it"),
    ]
    s = summarize_chaos(
        results, expected, faults, planned=4, tenant_names=["a", "b", "c"], t0=0.0, stop=20.0,
        end=22.0, migrations={"engine_died": 7},
    )  # fmt: skip
    q, o, f = s["requests"], s["outputs"], s["faults"]
    assert (q["sent"], q["completed"], q["failed"], q["lost"]) == (6, 3, 2, 1)
    assert q["failed_by_status"] == {"503": 1, "502": 1} and q["unclear_errors"] == 1
    assert q["lost_by_reason"] == {"connection": 1}
    assert (o["compared"], o["changed"]) == (3, 1) and "#2" in o["changes"][0]
    assert s["drain_s"] == 2.0 and s["output_tokens"] == 9
    assert s["output_tokens_per_s"] == pytest.approx(9 / 22)
    urgent = s["by_priority"]["-1"]
    assert urgent["ttft_ms"] == {"n": 2, "p50": pytest.approx(100), "p99": pytest.approx(300)}
    assert urgent["e2e_ms"]["p99"] == pytest.approx(2000)
    assert s["by_priority"]["5"]["ttft_ms"]["n"] == 0  # not streamed
    t = s["tenants"]
    assert (t["a"]["sent"], t["a"]["completed"], t["b"]["completed"], t["c"]["sent"]) == (
        3,
        1,
        2,
        1,
    )
    assert t["b"]["request_share"] == pytest.approx(2 / 3)
    assert t["b"]["output_token_share"] == pytest.approx(2 / 3) and t["c"]["request_share"] == 0
    assert (f["planned"], f["injected"], f["by_kind"]) == (4, 2, {"engine": 1, "replica": 1})
    assert f["closest_gap_s"] == pytest.approx(1.2) and f["repaired"] == 1
    assert len(f["not_injected"]) == 1 and f["repair_s"]["max"] == 4.0
    assert not chaos_ok(s)
    text = format_chaos(s)
    assert "6 requests in 20 s (+2.0 s to drain): 3 completed, 2 failed (503 1, 502 1)" in text
    assert "1 lost (connection 1)" in text and "1 changed" in text
    assert "faults: 2 of 4 planned injected (engine 1, replica 1), closest two 1.2 s" in text
    assert "serving again after 4.0 s" in text and "not repaired" in text
    assert "engine_died 7" in text and "CHANGED #2" in text and "LOST #5" in text
    assert o["changed_batch_dependent"] == 0 and "run alone" not in text
    # The offline engine, given request 2 alone, answers what was served: batch-dependent.
    for alone, dependent, note in (
        (Expected("xyz", "length", 3), 1, "run alone, the offline engine gives the served text"),
        (Expected("abc", "length", 3), 0, "run alone, the offline engine gives its batch answer"),
        (Expected("abz", "length", 3), 1, "run alone, the offline engine gives a third text"),
    ):
        again = summarize_chaos(
            results, expected, faults, planned=4, tenant_names=["a", "b", "c"], t0=0.0,
            stop=20.0, end=22.0, migrations=None, alone={2: alone},
        )  # fmt: skip
        assert again["outputs"]["changed"] == 1 and note in again["outputs"]["changes"][0]
        assert again["outputs"]["changed_batch_dependent"] == dependent
        assert ("depends on the batch" in format_chaos(again)) == bool(dependent)
    clean = summarize_chaos(
        results[:2] + results[3:5], expected, [], planned=0, tenant_names=["a", "b", "c"],
        t0=0.0, stop=1.0, end=1.0, migrations=None,
    )  # fmt: skip
    assert chaos_ok(clean) and "unknown (no Ray metrics endpoint)" in format_chaos(clean)
    # The offline engine failed: nothing compared, the figures still reported, not ok.
    blind = summarize_chaos(
        results[:2], "the offline engine failed: boom", [], planned=0,
        tenant_names=["a", "b", "c"], t0=0.0, stop=1.0, end=1.0, migrations=None,
    )  # fmt: skip
    assert blind["outputs"]["compared"] == 0 and blind["requests"]["completed"] == 2
    assert not chaos_ok(blind) and "OUTPUTS NOT COMPARED: the offline" in format_chaos(blind)


def test_migrations_are_read_from_the_routers_counter() -> None:
    page = "\n".join(
        [
            "# TYPE ray_kvray_request_migrations_total counter",
            'ray_kvray_request_migrations_total{Component="a",cause="engine_died"} 3.0',
            'ray_kvray_request_migrations_total{Component="b",cause="engine_died"} 2.0',
            'ray_kvray_request_migrations_total{cause="replica_unavailable",x="1"} 1.0',
            'ray_kvray_request_migrations_total_other{cause="engine_died"} 9.0',
            'kvray_router_requests_total{code="200"} 40.0',
        ]
    )
    before = counter_by_cause(page)
    assert before == {"engine_died": 5.0, "replica_unavailable": 1.0}
    after = {"engine_died": 8.0, "replica_unavailable": 1.0}
    assert migrations_between(before, after) == {"engine_died": 3}
    assert migrations_between(None, after) is None

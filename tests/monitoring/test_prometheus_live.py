"""Real Prometheus against a real local kvray cluster.

One start-up for the module: the session's Ray (tests/conftest.py: a free metrics export port,
a 1 s export interval), the kvray app with two demo-model replicas, and Debian's `prometheus`
running the shipped config and rules (intervals cut to 2 s). After a short load through the
official OpenAI client, Prometheus' HTTP API must show: every metric name the rules and the
dashboard reference; every recording rule with a number, every dashboard query with data,
every rule evaluating without error; token counters and the TTFT count equal to the API's
usage, and KV usage, running and waiting back to 0 after the load; `promtool check metrics`
accepting the kvray families of a real scrape.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml

from tests.cluster.serve_helpers import RaySession, ServePorts
from tests.monitoring.promkit import (
    EVENT_METRICS,
    KVRAY_METRICS,
    MONITORING,
    RULES_DIR,
    dashboard_histograms,
    dashboard_queries,
    kvray_exposition,
    load_dashboard,
    referenced_metric_names,
    rule_expressions,
    run_promtool,
    scrape,
    until_rated,
    wait_for,
)

pytestmark = pytest.mark.slow

T = TypeVar("T")

NUM_REPLICAS = 2
# A family of prompts sharing a long prefix (several KV blocks) so the prefix cache has hits.
SHARED_PREFIX = "The quick brown fox jumps over the lazy dog while the sun sets slowly. " * 6


@dataclass
class Stack:
    http_url: str
    metrics_url: str
    prom_url: str
    model: str
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=30))

    def query(self, promql: str) -> list[dict[str, Any]]:
        """Instant query; raises on a parse or evaluation error."""
        resp = self.http.get(f"{self.prom_url}/api/v1/query", params={"query": promql})
        body = resp.json()
        assert resp.status_code == 200 and body["status"] == "success", (promql, body)
        return body["data"]["result"]

    def scalar(self, promql: str) -> float | None:
        result = self.query(promql)
        return float(result[0]["value"][1]) if result else None


def _prometheus_config(tmp: Path, metrics_port: int) -> Path:
    """The shipped prometheus.yml with 2 s intervals, the test's target and absolute rules."""
    config = yaml.safe_load((MONITORING / "prometheus" / "prometheus.yml").read_text())
    # Not 1 s: a scrape of Ray's exporter can take most of a second on a busy 2-core host.
    config["global"].update(scrape_interval="2s", evaluation_interval="2s")
    config["rule_files"] = [str(RULES_DIR / "*.yml")]
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{metrics_port}"]}]
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


APP, PREFIX = "kvray-prom", "/prom"


@pytest.fixture(scope="module")
def stack(ray_session: RaySession, serve_ports: ServePorts) -> Iterator[Stack]:
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("prometheus missing: run monitoring/install_prometheus.sh")
    from ray import serve

    from cluster.config import ServeConfig
    from cluster.deploy.app import build_app

    # The checks below read cluster-wide sums (tokens of every request, LLMServer replicas):
    # tests/conftest.py runs this module before any other deploys a kvray app.
    others = set(serve.status().applications)
    assert not others, f"applications deployed before the monitoring test: {others}"
    metrics_port = int(urllib.parse.urlsplit(ray_session.metrics_url).port or 0)
    tmp = Path(tempfile.mkdtemp(prefix="kvray-prom-"))
    proc: subprocess.Popen[bytes] | None = None
    try:
        config = ServeConfig.from_flat(
            num_replicas=NUM_REPLICAS,
            device="cpu",
            max_model_len=512,
            kv_cache_memory_bytes=32 * 1024 * 1024,
            max_num_seqs=16,
        )
        serve.run(build_app(config), name=APP, route_prefix=PREFIX)

        log = tmp / "prometheus.log"
        proc = subprocess.Popen(
            [
                prometheus,
                f"--config.file={_prometheus_config(tmp, metrics_port)}",
                f"--storage.tsdb.path={tmp / 'data'}",
                # Port 0: Prometheus binds a free port itself and logs it (no race for one).
                "--web.listen-address=127.0.0.1:0",
            ],
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        prom_url = wait_for(
            lambda: _listening_url(proc, log), bool, "prometheus listening", timeout_s=60
        )
        wait_for(lambda: _ready(f"{prom_url}/-/ready"), bool, "prometheus ready", timeout_s=60)
        stack = Stack(
            http_url=f"http://127.0.0.1:{serve_ports.http}{PREFIX}",
            metrics_url=ray_session.metrics_url,
            prom_url=prom_url,
            model=config.engine.model_name(),
        )
        # A baseline before the load: rate() needs samples from before the counters moved.
        wait_for(
            lambda: stack.scalar("count_over_time(ray_kvray_kv_cache_blocks[1m])"),
            lambda n: n is not None and n >= 3,
            "three scrapes of the idle cluster",
        )
        yield stack
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        serve.delete(APP)
        shutil.rmtree(tmp, ignore_errors=True)


def _listening_url(proc: subprocess.Popen[bytes], log: Path) -> str:
    if proc.poll() is not None:
        raise AssertionError(f"prometheus exited:\n{log.read_text()[-3000:]}")
    found = re.search(r'msg="Listening on" address=(\S+)', log.read_text())
    return f"http://{found.group(1)}" if found else ""


def _ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass(frozen=True)
class Served:
    prompt_tokens: int
    completion_tokens: int


@pytest.fixture(scope="module")
def load(stack: Stack) -> list[Served]:
    """A short mixed load through the OpenAI API; returns the usage of every served request."""
    import openai

    client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0)

    def completion(i: int) -> Served:
        resp = client.completions.create(
            model=stack.model,
            prompt=f"{SHARED_PREFIX} Story number {i}:",
            max_tokens=8 + i % 9,
            temperature=0.0,
        )
        return Served(resp.usage.prompt_tokens, resp.usage.completion_tokens)

    def streamed_chat(i: int) -> Served:
        stream = client.chat.completions.create(
            model=stack.model,
            messages=[{"role": "user", "content": f"{SHARED_PREFIX} Question {i}?"}],
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = [chunk.usage for chunk in stream if chunk.usage is not None]
        assert len(usage) == 1
        return Served(usage[0].prompt_tokens, usage[0].completion_tokens)

    def constrained(i: int) -> Served:  # feeds the structured-output metrics
        # Choices of their own: a new grammar to compile in each wave (the compile-time
        # histogram needs observations in both for rate() to have data).
        choices = [f"yes {i}", f"no {i}"]
        resp = client.completions.create(
            model=stack.model,
            prompt=f"{SHARED_PREFIX} Answer {i}:",
            max_tokens=8,
            extra_body={"structured_outputs": {"choice": choices}},
        )
        assert resp.choices[0].text in choices
        return Served(resp.usage.prompt_tokens, resp.usage.completion_tokens)

    def run(jobs: list[tuple[Callable[[int], Served], int]]) -> list[Served]:
        with ThreadPoolExecutor(max_workers=6) as pool:
            return list(pool.map(lambda job: job[0](job[1]), jobs))

    def wave(k: int, completions: int, chats: int, grammars: int) -> list[Served]:
        return run(
            [(completion, 100 * k + i) for i in range(completions)]
            + [(streamed_chat, 100 * k + i) for i in range(chats)]
            + [(constrained, 100 * k + i) for i in range(grammars)]
        )

    # Series are born at their first observation: Prometheus has them all before wave two.
    served = wave(0, 4, 2, 2)
    names = ["ray_kvray_time_to_first_token_seconds", *sorted(dashboard_histograms())]
    wait_for(
        lambda: [stack.scalar(f"sum({name}_count)") for name in names],
        lambda v: None not in v and v[0] >= len(served),
        "the first wave in Prometheus",
    )
    served += wave(1, 12, 6, 2)
    until_rated(stack.scalar, names, lambda k: served.extend(wave(2 + k, 2, 1, 2)))

    # Client errors, so the error panels and the code label have something to show.
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=stack.model, prompt="x", max_tokens=4, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=4)

    # Prometheus has every request once the scraped TTFT count reaches the number served, and
    # the recording rules have run on it once the recorded rate is non-zero.
    wait_for(
        lambda: stack.scalar("sum(ray_kvray_time_to_first_token_seconds_count)"),
        lambda v: v is not None and v >= len(served),
        "all requests in Prometheus",
    )
    wait_for(
        lambda: stack.scalar("sum(model:kvray_generation_tokens:rate1m)"),
        lambda v: v is not None and v > 0,
        "recording rules over the load",
    )
    return served


def _finite(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(r["value"][1])) for r in result)


def test_every_referenced_metric_name_is_scraped(stack: Stack, load: list[Served]) -> None:
    exprs = [e for _, e in rule_expressions()]
    exprs += [e for _, e in dashboard_queries(load_dashboard())]
    referenced = referenced_metric_names(exprs)
    # Series of a histogram whose event (a replica failure) this load does not cause.
    referenced = {n for n in referenced if not any(f"ray_{e}" in n for e in EVENT_METRICS)}
    resp = stack.http.get(f"{stack.prom_url}/api/v1/label/__name__/values").json()
    known = set(resp["data"])
    assert referenced - known == set()
    # ... and every metric of monitoring/README.md's table, whether or not a query uses it.
    exported = {n[len("ray_") :] for n in known if n.startswith("ray_kvray_")}
    expected = {
        f"{n}_count" if kind == "histogram" else n
        for n, kind in KVRAY_METRICS.items()
        if n not in EVENT_METRICS
    }
    assert expected <= exported


def test_engine_series_are_labelled_per_replica(stack: Stack, load: list[Served]) -> None:
    result = stack.query("count by (model, replica) (ray_kvray_kv_cache_blocks)")
    assert {r["metric"]["model"] for r in result} == {stack.model}
    assert len({r["metric"]["replica"] for r in result}) == NUM_REPLICAS
    healthy = stack.scalar('sum(ray_serve_deployment_replica_healthy{deployment="LLMServer"})')
    assert healthy == NUM_REPLICAS


def _settled(produce: Callable[[], T], expected: T, what: str) -> T:
    """`produce()` once it equals `expected`, else its last value after the bound. Values
    trail the load by Ray's export interval plus a scrape and a rule evaluation, and not all
    series arrive in the same scrape."""
    return wait_for(produce, lambda v: v == expected, what, timeout_s=60)


def test_every_recording_rule_produces_a_number(stack: Stack, load: list[Served]) -> None:
    records = sorted({name for name, _ in rule_expressions() if not name[0].isupper()})

    def empty() -> list[str]:
        return [name for name in records if not _finite(stack.query(name))]

    assert _settled(empty, [], "every recording rule with a number") == []


def test_every_rule_evaluates_without_error(stack: Stack, load: list[Served]) -> None:
    groups = stack.http.get(f"{stack.prom_url}/api/v1/rules").json()["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == len(rule_expressions())
    bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert bad == []
    firing = [r["name"] for r in rules if r["type"] == "alerting" and r["state"] == "firing"]
    assert firing == []


def _expect_data(queries: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The (title, expr) queries this load gives data: not those of a histogram whose event
    (a replica failure: EVENT_METRICS) it never causes."""
    return [(t, e) for t, e in queries if not any(f"ray_{m}" in e for m in EVENT_METRICS)]


def test_every_dashboard_query_returns_data(stack: Stack, load: list[Served]) -> None:
    # A window covering the whole load, as a person looking at the last minutes would see.
    queries = _expect_data(dashboard_queries(load_dashboard(), {"__rate_interval": "5m"}))

    def dead() -> list[tuple[str, str]]:
        return [(title, expr) for title, expr in queries if not _finite(stack.query(expr))]

    assert _settled(dead, [], "every dashboard query with data") == []


def test_token_counters_equal_the_api_usage_sums(stack: Stack, load: list[Served]) -> None:
    prompt = sum(s.prompt_tokens for s in load)
    completion = sum(s.completion_tokens for s in load)
    queries = (
        "sum(ray_kvray_prompt_tokens_total)",
        "sum(ray_kvray_generation_tokens_total)",
        "sum(ray_kvray_time_to_first_token_seconds_count)",
        "sum(ray_kvray_e2e_request_latency_seconds_count)",
        "sum(ray_kvray_request_success_total)",
    )
    expected = (prompt, completion, len(load), len(load), len(load))
    got = _settled(lambda: tuple(stack.scalar(q) for q in queries), expected, "token counters")
    assert got == expected
    # The exporter itself agrees (no Prometheus arithmetic in between).
    s = scrape(stack.metrics_url)
    assert s.value("ray_kvray_prompt_tokens_total") == prompt
    assert s.value("ray_kvray_generation_tokens_total") == completion


def test_router_counted_successes_and_client_errors(stack: Stack, load: list[Served]) -> None:
    def seen() -> tuple[object, ...]:
        ok = stack.scalar('sum(ray_kvray_router_requests_total{protocol="http", code="200"})')
        hits = stack.scalar("sum(ray_kvray_prefix_cache_hits_total)")
        return (
            (ok or 0) >= len(load),
            stack.scalar('sum(ray_kvray_router_requests_total{code="400"})'),
            stack.scalar('sum(ray_kvray_router_requests_total{code="404"})'),
            (hits or 0) > 0,  # the shared prefix was found in the prefix cache
        )

    expected = (True, 1.0, 1.0, True)
    assert _settled(seen, expected, "router counters and prefix-cache hits") == expected


def test_gauges_return_to_zero_after_the_load(stack: Stack, load: list[Served]) -> None:
    def idle() -> tuple[float | None, ...]:
        return (
            stack.scalar("max(ray_kvray_kv_cache_usage_ratio)"),
            stack.scalar("sum(ray_kvray_num_requests_running)"),
            stack.scalar("sum(ray_kvray_num_requests_waiting)"),
        )

    assert wait_for(idle, lambda v: v == (0.0, 0.0, 0.0), "idle gauges") == (0.0, 0.0, 0.0)


def test_promtool_check_metrics_on_a_real_scrape(stack: Stack, load: list[Served]) -> None:
    result = run_promtool(
        "check", "metrics", stdin=kvray_exposition(scrape(stack.metrics_url).text)
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_queries_run_as_range_queries(stack: Stack, load: list[Served]) -> None:
    """What a Grafana time-series panel sends: query_range over the last minutes."""
    end = time.time()
    for title, expr in _expect_data(dashboard_queries(load_dashboard(), {"__rate_interval": "1m"})):
        params = {"query": expr, "start": end - 120, "end": end, "step": "5"}
        body = stack.http.get(
            f"{stack.prom_url}/api/v1/query_range?{urllib.parse.urlencode(params)}"
        ).json()
        assert body["status"] == "success", (title, body)
        assert body["data"]["result"], title

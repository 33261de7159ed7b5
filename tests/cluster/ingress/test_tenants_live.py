"""Tenants and quotas through a real deployment: one app whose keys file names the tenants,
with a one-slot engine that sleeps before every step so a queue can be watched.

- a tenant over its request quota gets 429 + Retry-After naming the quota (gRPC:
  RESOURCE_EXHAUSTED, same message) while another tenant keeps getting answers; two keys of
  one tenant share its quota; the token quota likewise;
- a burst of one tenant fills the replica's queue; another tenant's request still gets in
  (its fair share) and runs before the burst's queue (the engine takes tenants in turn), so it
  answers 200 where first come, first served would have kept it past the queue timeout;
- the per-tenant metrics, scraped from Ray's exporter, carry the tenants' labels.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import openai
import pytest
import yaml

from cluster.config import ServeConfig
from tests.cluster.serve_helpers import (
    TEST_GRPC_DRAIN_S,
    App,
    RaySession,
    ServePorts,
    free_port,
    openai_client,
    replica_stats,
    wait_for,
    wait_until_idle,
)
from tests.monitoring.promkit import scrape
from tests.monitoring.promkit import wait_for as wait_for_value

pytestmark = pytest.mark.slow

STEP_SLEEP_S = 0.05
MAX_QUEUED = 4
# A burst request runs >= BURST_TOKENS steps (3 s): behind four of them first come, first
# served, a request waits >= 12 s, past the queue timeout; in turn with them, <= one of them.
BURST_TOKENS = 60
QUEUE_TIMEOUT_S = 8.0
CLIENT_TIMEOUT_S = 120.0  # hang guard
KEYS = {
    "keys": [
        {"key": "sk-acme-1", "name": "acme", "requests_per_s": 0.01, "requests_burst": 2},
        {"key": "sk-acme-2", "name": "acme"},
        {"key": "sk-beta", "name": "beta"},
        {"key": "sk-tok", "name": "tok", "tokens_per_s": 1, "tokens_burst": 100},
        {"key": "sk-burst", "name": "burst"},
        {"key": "sk-calm", "name": "calm"},
    ]
}


@dataclass(frozen=True)
class TenantsApp(App):
    grpc: str = ""  # host:port of the app's own gRPC ingress


@pytest.fixture(scope="module")
def app(serve_ports: ServePorts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TenantsApp]:
    from ray import serve

    from cluster.deploy.app import ingress_options, llm_server_options
    from cluster.grpc_api.ingress import GrpcSettings, bind_grpc_ingress
    from cluster.http.ingress import OpenAIIngress
    from cluster.replica.llm_server import LLMServer
    from workers.core.engine_child import TEST_STEP_SLEEP_ENV

    keys = tmp_path_factory.mktemp("tenants") / "keys.yaml"
    keys.write_text(yaml.safe_dump(KEYS))
    config = ServeConfig.from_flat(
        grpc_drain_s=TEST_GRPC_DRAIN_S,
        num_replicas=1,
        kv_cache_memory_bytes=1 << 22,
        max_num_seqs=1,
        max_queued_requests=MAX_QUEUED,
        queue_timeout_s=QUEUE_TIMEOUT_S,
        api_keys_file=str(keys),
        api_key_env="KVRAY_TENANTS_NO_KEY",  # unset: the keys file's keys only
    )
    # As tests.cluster.serve_helpers.deploy_with_engine_env, with a gRPC port of its own (the
    # other apps' gRPC ingresses share Serve's).
    opts = llm_server_options(config)
    env = {TEST_STEP_SLEEP_ENV: str(STEP_SLEEP_S)}
    opts["ray_actor_options"] = {**opts["ray_actor_options"], "runtime_env": {"env_vars": env}}
    llm = serve.deployment(LLMServer, **opts).bind(config)
    grpc_port = free_port()
    settings = GrpcSettings.from_config(config, host="127.0.0.1", port=grpc_port)
    grpc_node = bind_grpc_ingress(config, llm, settings)
    ingress = serve.deployment(OpenAIIngress, **ingress_options(config)).bind(
        config, llm, grpc_node
    )
    serve.run(ingress, name="kvray-tenants", route_prefix="/tenants")
    base = f"http://127.0.0.1:{serve_ports.http}/tenants"
    yield TenantsApp(
        "kvray-tenants", base, config.engine.model_name(), None, f"127.0.0.1:{grpc_port}"
    )
    serve.delete("kvray-tenants")


def _complete(app: App, key: str, max_tokens: int = 2, **kw: Any) -> httpx.Response:
    body = {"model": app.model, "prompt": list(range(5, 15)), "max_tokens": max_tokens, **kw}
    return httpx.post(
        f"{app.base_url}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=CLIENT_TIMEOUT_S,
    )


def _rate_limited(r: httpx.Response, message: str) -> None:
    assert r.status_code == 429, r.text
    assert int(r.headers["Retry-After"]) >= 1
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "rate_limit_exceeded" and message in err["message"], err


def test_over_its_request_quota_a_tenant_gets_429_and_others_keep_answering(app: App) -> None:
    # acme: 2 requests, then 1 per 100 s, shared by its two keys.
    acme1 = openai_client(app, api_key="sk-acme-1")
    acme1.completions.create(model=app.model, prompt="one", max_tokens=2)
    _complete(app, "sk-acme-2").raise_for_status()
    with pytest.raises(openai.RateLimitError) as err:
        acme1.completions.create(model=app.model, prompt="three", max_tokens=2)
    assert "tenant 'acme' is over its requests_per_s quota (0.01)" in err.value.message
    assert int(err.value.response.headers["retry-after"]) > 50  # the next in about 100 s
    _rate_limited(_complete(app, "sk-acme-2"), "tenant 'acme' is over its requests_per_s quota")
    beta = openai_client(app, api_key="sk-beta")
    for i in range(4):
        out = beta.completions.create(model=app.model, prompt=f"beta {i}", max_tokens=2)
        assert out.usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai_client(app, api_key="sk-unknown").models.list()


def test_the_token_quota_counts_prompt_and_max_tokens(app: App) -> None:
    # tok: 100 tokens, 1 more per second; a request costs 10 prompt + max_tokens tokens.
    assert _complete(app, "sk-tok", max_tokens=50, ignore_eos=True).status_code == 200
    _rate_limited(
        _complete(app, "sk-tok", max_tokens=50), "tenant 'tok' is over its tokens_per_s quota (1)"
    )
    assert _complete(app, "sk-tok", max_tokens=2).status_code == 200  # a small one fits


def test_grpc_enforces_the_same_quota_with_resource_exhausted(app: TenantsApp) -> None:
    from cluster.grpc_api.client import KvrayClient

    target = app.grpc
    with KvrayClient(target, "sk-acme-1", timeout=CLIENT_TIMEOUT_S) as acme:
        acme.generate("one", max_tokens=2)  # gRPC's buckets are its own (docs/serving.md)
        with KvrayClient(target, "sk-acme-2", timeout=CLIENT_TIMEOUT_S) as acme2:
            acme2.generate("two", max_tokens=2)
        with pytest.raises(grpc.RpcError) as err:
            acme.generate("three", max_tokens=2)
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tenant 'acme' is over its requests_per_s quota (0.01)" in err.value.details()
    with KvrayClient(target, "sk-beta", timeout=CLIENT_TIMEOUT_S) as beta:
        assert beta.generate("beta", max_tokens=2).usage.completion_tokens == 2


def _holder(app: App, started: threading.Event, stop: threading.Event) -> threading.Thread:
    """A stream of the burst tenant holding the only sequence slot (sets `started`) until
    `stop`, then hanging up."""

    def hold() -> None:
        body = {"model": app.model, "prompt": [5] * 8, "max_tokens": 900, "stream": True}
        body |= {"ignore_eos": True}
        headers = {"Authorization": "Bearer sk-burst"}
        url = f"{app.base_url}/v1/completions"
        with httpx.stream("POST", url, json=body, headers=headers, timeout=CLIENT_TIMEOUT_S) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    started.set()
                if stop.is_set():
                    break
        started.set()

    return threading.Thread(target=hold)


def test_a_burst_of_one_tenant_does_not_hold_another_back(app: App) -> None:
    answers: dict[str, list[httpx.Response]] = {"burst": [], "calm": []}

    def send(tenant: str, max_tokens: int) -> threading.Thread:
        def run() -> None:
            r = _complete(app, f"sk-{tenant}", max_tokens=max_tokens, ignore_eos=True)
            answers[tenant].append(r)

        t = threading.Thread(target=run)
        t.start()
        return t

    def queued() -> int:
        (s,) = replica_stats(app, 1).values()
        return s["queued"]

    started, stop = threading.Event(), threading.Event()
    hold = _holder(app, started, stop)
    hold.start()
    threads: list[threading.Thread] = []
    try:
        assert started.wait(CLIENT_TIMEOUT_S)
        # The burst: MAX_QUEUED requests fill the queue behind the held slot, the rest: 429.
        threads += [send("burst", BURST_TOKENS) for _ in range(MAX_QUEUED + 3)]
        wait_for(lambda: queued() == MAX_QUEUED, "the burst filling the queue")
        wait_for(lambda: len(answers["burst"]) == 3, "the burst's refusals")
        for r in answers["burst"]:
            assert r.status_code == 429, r.text
            assert f"max_queued_requests={MAX_QUEUED}" in r.json()["error"]["message"]
        # The queue is full of the burst: the calm tenant holds none of it, under its share.
        threads.append(send("calm", 2))
        wait_for(lambda: queued() == MAX_QUEUED + 1, "the calm request queued")
        # Over its share, the burst is the one refused.
        refused = _complete(app, "sk-burst", max_tokens=BURST_TOKENS)
        assert refused.status_code == 429 and "max_queued_requests" in refused.text
    finally:
        stop.set()
        hold.join(CLIENT_TIMEOUT_S)
        for t in threads:
            t.join(CLIENT_TIMEOUT_S)
    (calm,) = answers["calm"]
    # Its turn came after one of the burst's requests, not after all of them (first come,
    # first served, it would have waited past the queue timeout: 503).
    assert calm.status_code == 200, calm.text
    assert {r.status_code for r in answers["burst"]} <= {200, 429, 503}
    wait_until_idle(app, replicas=1)


def test_metrics_by_tenant(app: App, ray_session: RaySession) -> None:
    expected = {
        # HTTP's and gRPC's ingress each count their own; the scrape sums them.
        ("rejected_total", "acme", "quota_requests"): 3,
        ("requests_total", "acme", None): 4,  # 2 over HTTP, 2 over gRPC
        ("requests_total", "beta", None): 5,
        ("tokens_total", "beta", None): 5 * 2 + 5,  # 2 generated and a prompt each, at least
        ("rejected_total", "tok", "quota_tokens"): 1,
        ("rejected_total", "burst", "queue_full"): 4,
        ("queue_time_seconds_count", "calm", None): 1,
    }

    def short() -> dict[tuple[str, str, str | None], float]:
        scraped = scrape(ray_session.metrics_url)
        found = {}
        for (name, tenant, reason), least in expected.items():
            labels = {"tenant": tenant} | ({"reason": reason} if reason else {})
            value = scraped.value(f"ray_kvray_tenant_{name}", **labels) or 0.0
            if value < least:
                found[(name, tenant, reason)] = value
        return found

    # Ray exports every few seconds: wait until everything above has arrived.
    assert wait_for_value(short, lambda s: not s, "the tenants' metrics exported") == {}
    scraped = scrape(ray_session.metrics_url)
    # Every named tenant's series exist from the start, at 0 until something happens.
    rejected = "ray_kvray_tenant_rejected_total"
    for tenant in ("acme", "beta", "tok", "burst", "calm", "default"):
        assert scraped.find(rejected, tenant=tenant, reason="quota_tokens"), tenant
    assert scraped.value(rejected, tenant="calm", reason="queue_full") == 0
    # Keys never become labels.
    assert not any("sk-" in v for s in scraped.samples for v in s.labels.values())

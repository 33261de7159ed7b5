"""Queue and request timeouts through the real server: a request no engine starts within
queue_timeout_s gets 503 + Retry-After in OpenAI's error format; a stream past
request_timeout_s ends with a 504 error event and is aborted; every KV block comes back.

The app's engine sleeps before every step (workers/core/engine_child.py's test hook), so a
long request surely outlasts both limits on any machine: the timing is made, not measured.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from cluster.config import ServeConfig
from tests.cluster.serve_helpers import App, ServePorts, deploy_with_engine_env, wait_until_idle

pytestmark = pytest.mark.slow

STEP_SLEEP_S = 0.02  # each engine step: 1000 tokens take >= 20 s
QUEUE_TIMEOUT_S = 1.0
REQUEST_TIMEOUT_S = 4.0
CLIENT_TIMEOUT_S = 120.0  # hang guard


@pytest.fixture(scope="module")
def slow_app(serve_ports: ServePorts) -> Iterator[App]:
    """One replica running one sequence at a time, each step slowed by the test hook."""
    from ray import serve

    from workers.core.engine_child import TEST_STEP_SLEEP_ENV

    config = ServeConfig.from_flat(
        num_replicas=1,
        kv_cache_memory_bytes=1 << 22,
        max_num_seqs=1,
        queue_timeout_s=QUEUE_TIMEOUT_S,
        request_timeout_s=REQUEST_TIMEOUT_S,
        api_key_env="KVRAY_TIMEOUTS_NO_KEY",  # unset on the cluster: no key required
    )
    env = {TEST_STEP_SLEEP_ENV: str(STEP_SLEEP_S)}
    app = deploy_with_engine_env("kvray-timeouts", "/timeouts", config, serve_ports, env)
    yield app
    serve.delete(app.name)


def _body(app: App, **kw: Any) -> dict[str, Any]:
    return {"model": app.model, "prompt": "Once upon a time", "temperature": 0.0, **kw}


def test_queue_timeout_is_a_503_with_retry_after_and_the_stream_ahead_times_out(
    slow_app: App,
) -> None:
    started = threading.Event()
    events: list[dict[str, Any]] = []

    def long_stream() -> None:
        body = _body(slow_app, max_tokens=1000, ignore_eos=True, stream=True)
        url = f"{slow_app.base_url}/v1/completions"
        with httpx.stream("POST", url, json=body, timeout=CLIENT_TIMEOUT_S) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line.removeprefix("data: ")))
                    started.set()
        started.set()

    holder = threading.Thread(target=long_stream)
    holder.start()
    try:
        assert started.wait(CLIENT_TIMEOUT_S)
        # The only sequence slot is taken for 20 s or more: this one cannot start in 1 s.
        r = httpx.post(
            f"{slow_app.base_url}/v1/completions",
            json=_body(slow_app, max_tokens=4),
            timeout=CLIENT_TIMEOUT_S,
        )
        assert r.status_code == 503, r.text
        assert int(r.headers["Retry-After"]) >= 1
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "service_unavailable" and "queue_timeout_s" in err["message"]
    finally:
        holder.join(CLIENT_TIMEOUT_S)
    # The long stream ran into request_timeout_s: tokens first, then the error event.
    assert any("choices" in e for e in events), events[:3]
    last = events[-1]
    assert last["error"]["type"] == "timeout_error", last
    assert last["error"]["code"] == 504 and "request_timeout_s" in last["error"]["message"]
    stats = wait_until_idle(slow_app, replicas=1)
    (replica,) = stats.values()
    assert replica["kv_blocks_used"] == 0 and replica["num_requests_running"] == 0, replica


def test_a_request_that_ends_in_time_is_untouched(slow_app: App) -> None:
    r = httpx.post(
        f"{slow_app.base_url}/v1/completions",
        json=_body(slow_app, max_tokens=8, ignore_eos=True),
        timeout=CLIENT_TIMEOUT_S,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8

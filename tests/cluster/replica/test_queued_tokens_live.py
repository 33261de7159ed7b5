"""Admission by prompt tokens through the real server: with a replica's one sequence slot held
by a long stream, long prompts queue up in its engine until the next one would pass
max_queued_tokens: that one gets 429 + Retry-After naming the limit, while a short prompt that
fits is still taken, and everything queued completes once the slot frees. And priorities: the
most urgent of the queued requests runs first.

The engine sleeps before every step (workers/core/engine_child.py's test hook) and runs one
sequence at a time, so the queue stays put while the test looks at it: each step is waited
for by the replica's stats, not by the clock.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from cluster.config import ServeConfig
from tests.cluster.serve_helpers import (
    App,
    ServePorts,
    deploy_with_engine_env,
    replica_stats,
    wait_until_idle,
)

pytestmark = pytest.mark.slow

STEP_SLEEP_S = 0.05  # each engine step: the 1000-token holder runs >= 50 s unless aborted
LONG, SHORT = 200, 100  # prompt tokens
MAX_QUEUED_TOKENS = 2 * LONG + SHORT  # two long prompts and a short one fit, a third long not
CLIENT_TIMEOUT_S = 120.0  # hang guard
WAIT_S = 60.0  # hang guard of each wait for the replica's stats


@pytest.fixture(scope="module")
def queued_app(serve_ports: ServePorts) -> Iterator[App]:
    from ray import serve

    from workers.core.engine_child import TEST_STEP_SLEEP_ENV

    config = ServeConfig.from_flat(
        num_replicas=1,
        kv_cache_memory_bytes=1 << 22,
        max_num_seqs=1,
        max_queued_tokens=MAX_QUEUED_TOKENS,
        api_key_env="KVRAY_QUEUED_TOKENS_NO_KEY",  # unset on the cluster: no key required
    )
    env = {TEST_STEP_SLEEP_ENV: str(STEP_SLEEP_S)}
    app = deploy_with_engine_env("kvray-queued-tokens", "/queued-tokens", config, serve_ports, env)
    yield app
    serve.delete(app.name)


def _body(app: App, prompt_len: int, **kw: Any) -> dict[str, Any]:
    prompt = [5 + i % 200 for i in range(prompt_len)]
    return {"model": app.model, "prompt": prompt, "temperature": 0.0, "max_tokens": 2, **kw}


def _wait_for_engine_queue(app: App, tokens: int) -> dict[str, Any]:
    """Until the engine itself reports `tokens` waiting and the replica counts nothing more
    (its own count of admissions the engine had not shown yet is gone)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        (s,) = replica_stats(app, 1).values()
        if s["num_waiting_prefill_tokens"] == tokens and s["queued_tokens"] == tokens:
            return s
        assert time.monotonic() < deadline, f"engine never queued {tokens} tokens: {s}"
        time.sleep(0.1)


def _holder(app: App, started: threading.Event, stop: threading.Event) -> threading.Thread:
    """A thread that takes the only sequence slot (sets `started`) until `stop`, then hangs
    up."""

    def hold() -> None:
        body = _body(app, 8, max_tokens=1000, ignore_eos=True, stream=True)
        url = f"{app.base_url}/v1/completions"
        with httpx.stream("POST", url, json=body, timeout=CLIENT_TIMEOUT_S) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    started.set()
                if stop.is_set():
                    break
        started.set()

    return threading.Thread(target=hold)


def test_long_prompts_fill_the_token_queue_and_a_short_one_still_fits(queued_app: App) -> None:
    url = f"{queued_app.base_url}/v1/completions"
    started, stop = threading.Event(), threading.Event()
    answers: dict[str, httpx.Response] = {}

    def post(name: str, prompt_len: int) -> threading.Thread:
        def send() -> None:
            answers[name] = httpx.post(
                url, json=_body(queued_app, prompt_len), timeout=CLIENT_TIMEOUT_S
            )

        t = threading.Thread(target=send)
        t.start()
        return t

    hold = _holder(queued_app, started, stop)
    hold.start()
    queued: list[threading.Thread] = []
    try:
        assert started.wait(CLIENT_TIMEOUT_S)
        queued.append(post("long1", LONG))
        _wait_for_engine_queue(queued_app, LONG)
        queued.append(post("long2", LONG))
        stats = _wait_for_engine_queue(queued_app, 2 * LONG)
        assert stats["num_requests_running"] == 1 and stats["num_requests_waiting"] == 2

        r = httpx.post(url, json=_body(queued_app, LONG), timeout=CLIENT_TIMEOUT_S)
        assert r.status_code == 429, r.text
        assert int(r.headers["Retry-After"]) >= 1
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert f"max_queued_tokens={MAX_QUEUED_TOKENS}" in err["message"], err
        assert f"{2 * LONG} + this request's {LONG}" in err["message"], err

        queued.append(post("short", SHORT))  # 2 * LONG + SHORT: exactly at the limit
        _wait_for_engine_queue(queued_app, MAX_QUEUED_TOKENS)
    finally:
        stop.set()
        hold.join(CLIENT_TIMEOUT_S)
        for t in queued:
            t.join(CLIENT_TIMEOUT_S)
    # The slot freed: everything that was let in ran.
    for name in ("long1", "long2", "short"):
        assert answers[name].status_code == 200, (name, answers[name].text)
        assert answers[name].json()["usage"]["completion_tokens"] == 2
    (replica,) = wait_until_idle(queued_app, replicas=1).values()
    assert replica["kv_blocks_used"] == 0 and replica["queued_tokens"] == 0, replica
    assert json.dumps(replica)  # the stats travel as JSON (routing stats, benches)


def test_the_most_urgent_queued_request_runs_first(queued_app: App) -> None:
    """Priorities through the server (HTTP's `priority`, vLLM's field): with the slot held,
    a less urgent request queues, then a more urgent one; once the slot frees, the urgent one
    runs first although it came second."""
    url = f"{queued_app.base_url}/v1/completions"
    started, stop = threading.Event(), threading.Event()
    done: list[str] = []

    def post(name: str, priority: int) -> threading.Thread:
        def send() -> None:
            body = _body(queued_app, SHORT, priority=priority)
            r = httpx.post(url, json=body, timeout=CLIENT_TIMEOUT_S)
            assert r.status_code == 200, r.text
            done.append(name)

        t = threading.Thread(target=send)
        t.start()
        return t

    hold = _holder(queued_app, started, stop)
    hold.start()
    queued: list[threading.Thread] = []
    try:
        assert started.wait(CLIENT_TIMEOUT_S)
        queued.append(post("later", 5))
        _wait_for_engine_queue(queued_app, SHORT)
        queued.append(post("urgent", -5))
        _wait_for_engine_queue(queued_app, 2 * SHORT)
    finally:
        stop.set()
        hold.join(CLIENT_TIMEOUT_S)
        for t in queued:
            t.join(CLIENT_TIMEOUT_S)
    assert done == ["urgent", "later"]
    bad = httpx.post(url, json=_body(queued_app, 8, priority="high"), timeout=CLIENT_TIMEOUT_S)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority", bad.text
    big = httpx.post(url, json=_body(queued_app, 8, priority=2**31), timeout=CLIENT_TIMEOUT_S)
    assert big.status_code == 400 and big.json()["error"]["param"] == "priority", big.text

"""LLMAutoscalingPolicy on the session's Ray instance: a burst scales LLMServer up, idleness
scales it down to zero (min_replicas 0), and the first request after that waits for a replica
to start and succeeds. Every request across all of it gets 200.

The engine sleeps before every step (workers/core/engine_child.py's test hook) and runs one
sequence at a time, so a burst surely leaves requests waiting on any machine; the delays are
short so the test is quick. The waits poll Serve's status with generous hang guards: nothing
here asserts on time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from cluster.config import ServeConfig
from tests.cluster.serve_helpers import KV_CACHE_BYTES, App, ServePorts, deploy_with_engine_env

pytestmark = pytest.mark.slow

APP = "kvray-autoscale"
STEP_SLEEP_S = 0.01
MAX_REPLICAS = 2
BURST = 8  # concurrent requests, one running per replica: the rest wait
HANG_GUARD_S = 90.0
CLIENT_TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def app(serve_ports: ServePorts) -> Iterator[App]:
    from ray import serve

    from workers.core.engine_child import TEST_STEP_SLEEP_ENV

    config = ServeConfig.from_flat(
        min_replicas=0,
        max_replicas=MAX_REPLICAS,
        target_waiting_requests=1.0,
        upscale_delay_s=1.0,
        downscale_delay_s=3.0,
        max_num_seqs=1,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        # A request arriving at zero replicas waits for one to start: never refused meanwhile.
        queue_timeout_s=0,
        api_key_env="KVRAY_AUTOSCALE_NO_KEY",  # unset on the cluster: no key required
    )
    env = {TEST_STEP_SLEEP_ENV: str(STEP_SLEEP_S)}
    yield deploy_with_engine_env(APP, "/autoscale", config, serve_ports, env)
    serve.delete(APP)


def running_replicas() -> int:
    from ray import serve

    dep = serve.status().applications[APP].deployments["LLMServer"]
    # Keys are ReplicaState members (str enums): compare by value.
    return sum(n for state, n in dep.replica_states.items() if str(state).endswith("RUNNING"))


def complete(app: App, i: int) -> int:
    body = {
        "model": app.model,
        "prompt": f"Request {i} of the burst: once upon a time",
        "max_tokens": 24,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    r = httpx.post(f"{app.base_url}/v1/completions", json=body, timeout=CLIENT_TIMEOUT_S)
    return r.status_code


def wait_for(replicas: int, app: App | None = None) -> int:
    """Polls until `replicas` run (sending bursts meanwhile when `app` is given); returns
    the count seen last. Every burst request must succeed."""
    deadline = time.monotonic() + HANG_GUARD_S
    n = running_replicas()
    with ThreadPoolExecutor(BURST) as pool:
        while n != replicas and time.monotonic() < deadline:
            if app is not None:
                codes = list(pool.map(lambda i: complete(app, i), range(BURST)))
                assert codes == [200] * BURST
            else:
                time.sleep(0.5)
            n = running_replicas()
    return n


def test_burst_scales_up_idleness_to_zero_and_the_next_request_starts_one(app: App) -> None:
    # initial_replicas: min 0 still starts one, and the policy keeps it while it starts.
    assert wait_for(1) == 1
    t0 = time.monotonic()
    assert wait_for(MAX_REPLICAS, app) == MAX_REPLICAS
    print(f"burst: {MAX_REPLICAS} replicas after {time.monotonic() - t0:.1f} s")
    # No request now: the policy's downscale delay passes, then replicas stop (drained).
    t0 = time.monotonic()
    assert wait_for(0) == 0
    print(f"idle: 0 replicas after {time.monotonic() - t0:.1f} s")
    t0 = time.monotonic()
    assert complete(app, -1) == 200  # waits for Serve to start a replica, then runs
    cold_start_s = time.monotonic() - t0
    assert running_replicas() >= 1
    print(f"scale from zero: first request answered after {cold_start_s:.1f} s")

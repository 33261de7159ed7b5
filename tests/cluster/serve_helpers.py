"""Helpers for the cluster tests: free ports, deploying apps, clients, replica stats."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

API_KEY_ENV = "KVRAY_TEST_API_KEY"
API_KEY = "test-key-5f2c"
# The environment the session's Ray instance starts with (tests/conftest.py): replicas read
# their API key from it, so apps with api_key_env=API_KEY_ENV require API_KEY.
RAY_ENV: dict[str, str] = {
    API_KEY_ENV: API_KEY,
    # Serve's handles report the requests they hold every 10 s by default; a request that
    # meets a deployment scaled to zero while its last replica stops waits for that report
    # before a replica starts (tests/cluster/controller): every second here.
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
    # A deleted app's ingress stays open this long for HAProxy to drop it (kvray's local
    # default: 2 s, cluster/deploy/serve_env.py); HAProxy on this machine drops it within a
    # fraction of a second, and the tests delete an app once they are done with it.
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0.5",
}
# A small KV cache per replica: plenty for the tests, little memory for 4-6 replicas.
KV_CACHE_BYTES = 64 * 1024 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class RaySession:
    metrics_url: str  # the node's Prometheus endpoint (Ray's metrics export port)


@dataclass(frozen=True)
class ServePorts:
    http: int
    grpc: int


@dataclass(frozen=True)
class App:
    name: str
    base_url: str  # http://127.0.0.1:PORT/PREFIX (OpenAI base_url = base_url + "/v1")
    model: str
    api_key: str | None

    def handle(self, deployment: str = "LLMServer") -> Any:
        from ray import serve

        handle = serve.get_deployment_handle(deployment, app_name=self.name)
        # kvray's Serve settings (applied to this process too) route on the caller's event
        # loop, which sync test code does not have: this handle routes on Serve's own thread,
        # so it works from sync code and from any event loop.
        if not handle.is_initialized:  # Serve hands out one cached handle per deployment
            handle._init(_run_router_in_separate_loop=True)
        return handle


# The gRPC ingress's NOT_SERVING period on shutdown (--grpc-drain-s, 5 s by default): nothing
# probes a test app's health while it is deleted, and each delete would wait it out.
TEST_GRPC_DRAIN_S = 0.5


def deploy(name: str, prefix: str, config: Any, ports: ServePorts, api_key: str | None) -> App:
    from ray import serve

    from cluster.deploy.app import build_app

    config = config.replace(grpc_drain_s=TEST_GRPC_DRAIN_S)
    serve.run(build_app(config), name=name, route_prefix=prefix)
    return App(name, f"http://127.0.0.1:{ports.http}{prefix}", config.engine.model_name(), api_key)


def openai_client(app: App, api_key: str | None = None) -> Any:
    import openai

    return openai.OpenAI(
        base_url=f"{app.base_url}/v1",
        api_key=api_key or app.api_key or "unused",
        max_retries=0,
        timeout=120,
    )


def replica_stats(app: App, expect_replicas: int, calls: int = 40) -> dict[str, dict[str, Any]]:
    """Each LLMServer replica's stats, by replica id.

    Each call carries a different routing key: the prefix-affinity router sends it to the
    replica that key prefers, so the calls reach every replica even while one of them is
    busy (by load alone, they would all go to the idle one).
    """
    handle = app.handle()
    seen: dict[str, dict[str, Any]] = {}
    for i in range(calls):
        s = handle.replica_stats.remote({"routing_key": f"stats-{i}"}).result()
        seen[s["replica"]] = s
        if len(seen) >= expect_replicas:
            break
    return seen


def wait_until_idle(app: App, replicas: int, timeout_s: float = 60.0) -> dict[str, dict[str, Any]]:
    """Polls until every replica reports no requests and no KV blocks in use (hang guard)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = replica_stats(app, replicas)
        idle = len(stats) >= replicas and all(
            s["num_requests_running"] == 0
            and s["num_requests_waiting"] == 0
            and s["kv_blocks_used"] == 0
            for s in stats.values()
        )
        if idle or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Polls `cond` until it holds; the bound is a hang guard, never a latency assert."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what} ({timeout_s:g} s)"
        time.sleep(0.05)


def pids_matching(match: Callable[[bytes], bool]) -> list[int]:
    """Processes of this machine (other than this one) whose NUL-separated command line
    `match` accepts (Linux /proc)."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if match(cmd):
            out.append(int(proc.name))
    return out


def deploy_with_engine_env(
    name: str,
    prefix: str,
    config: Any,
    ports: ServePorts,
    env: dict[str, str],
    **llm_options: Any,
) -> App:
    """`deploy` with extra environment variables in the LLMServer replicas (the engines' test
    hooks, workers/core/engine_child.py) and LLMServer deployment options overridden (health
    check periods, ...); no API key. The same application as cluster.deploy.app.build_app."""
    from ray import serve

    from cluster.deploy.app import ingress_options, llm_server_options
    from cluster.grpc_api.ingress import bind_grpc_ingress
    from cluster.http.ingress import OpenAIIngress
    from cluster.replica.llm_server import LLMServer

    config = config.replace(grpc_drain_s=TEST_GRPC_DRAIN_S)
    opts = {**llm_server_options(config), **llm_options}
    opts["ray_actor_options"] = {**opts["ray_actor_options"], "runtime_env": {"env_vars": env}}
    llm = serve.deployment(LLMServer, **opts).bind(config)
    grpc = bind_grpc_ingress(config, llm)
    ingress = serve.deployment(OpenAIIngress, **ingress_options(config)).bind(config, llm, grpc)
    serve.run(ingress, name=name, route_prefix=prefix)
    return App(name, f"http://127.0.0.1:{ports.http}{prefix}", config.engine.model_name(), None)


def store_bytes_within(bound: int) -> int:
    """The object store's bytes in use, once at most `bound` (frees are asynchronous; a
    hang guard of 30 s, then the assertion fails)."""
    from cluster.ray_internals import object_store_stats

    deadline = time.monotonic() + 30
    while (used := object_store_stats()["bytes_used"]) > bound:
        assert time.monotonic() < deadline, f"the object store holds {used} > {bound} bytes"
        time.sleep(0.1)
    return used


def tier_bytes(app_name: str) -> int:
    """The bytes of the blocks the application's cluster KV tier lists (its directory)."""
    import ray

    from cluster.ray_internals import KVRAY_NAMESPACE
    from cluster.replica.kv_directory import directory_name

    directory = ray.get_actor(directory_name(app_name), namespace=KVRAY_NAMESPACE)
    return int(ray.get(directory.stats.remote())["bytes"])

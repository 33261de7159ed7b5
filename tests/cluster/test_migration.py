"""Request migration end to end: 32 long requests (half greedy, half seeded sampling; HTTP
streamed and not, gRPC GenerateStream and Generate) while the replica serving many of them
loses its engine process, its actor, a TP rank, or is removed by a config update. Every
request must finish with exactly the text of an undisturbed run (the offline engine's) and
exact usage; the survivors must hold no KV block afterwards. A request that fails on more
replicas than --max-migrations allows gets a clear 503.

Without migration each of these faults ends the victim's requests with a 503 / UNAVAILABLE,
so every test here fails on a server that does not migrate.

The shared app runs as `kvray serve --async-scheduling` does: a killed engine then has a step
in flight whose tokens never reach the host, and the resumed streams must not miss or repeat
them. Synchronous engines are killed in the TP, two-node and max-migrations tests, and in
tests/cluster/ingress/test_migration.py. A small app (one sequence and SMALL_QUEUE waiting per
replica) also checks that streams within the queue caps are never refused (429).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from cluster.bench.fault.main import pid_gone
from cluster.cli.config import IMPORT_PATH
from cluster.config import ServeConfig
from tests.cluster.migration_load import (
    LoadRequest,
    build_load,
    busiest_replica,
    expected_texts,
    failures,
    kill_pid,
    start_load,
)
from tests.cluster.serve_helpers import (
    KV_CACHE_BYTES,
    App,
    ServePorts,
    deploy,
    replica_stats,
    wait_for,
    wait_until_idle,
)

pytestmark = pytest.mark.slow

# A stopped replica's requests move after this grace period (the config-update test).
GRACE_S = 2.0
NAME, PREFIX = "migration", "/migration"
DEFAULTS = ServeConfig()


def _config(**kw: object) -> ServeConfig:
    base = {
        "num_replicas": 2,
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
        "graceful_shutdown_timeout_s": GRACE_S,
        "api_key_env": "KVRAY_MIGRATION_NO_KEY",  # unset on the cluster: no key required
        # The cluster KV tier: a moved request pulls the blocks its first replica published
        # (prompt and outputs so far) where that is cheaper than recomputing them.
        "kv_offload_gib": 0.05,
        "kv_share_gib": 0.1,
    }
    return ServeConfig.from_flat(**{**base, **kw})


@pytest.fixture(scope="module")
def requests() -> list[LoadRequest]:
    # HTTP only here: Serve's gRPC port is shared (SO_REUSEPORT) with the session's other apps,
    # whose GrpcIngress may answer; gRPC migration runs in the two-node test's own cluster.
    return build_load(seed=15, vias=("http_stream", "http"))


@pytest.fixture(scope="module")
def expected(demo_dir: Path, requests: list[LoadRequest]) -> list[str]:
    return expected_texts(demo_dir, requests)


def _deploy(ports: ServePorts, replicas: int | None = None) -> App:
    """The app deployed as `serve deploy` does it, from a Serve config (import path + args);
    `replicas` overrides the LLMServer deployment's num_replicas in its `deployments:`
    section: a lightweight update, which changes no other deployment (the ingress, which
    carries the streams, stays)."""
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    from cluster.grpc_api.ingress import grpc_options

    config = _config(async_scheduling=True)
    args = {k: v for k, v in config.flat().items() if v != DEFAULTS.flat()[k]}
    spec: dict = {"name": NAME, "route_prefix": PREFIX, "import_path": IMPORT_PATH, "args": args}
    if replicas is not None:
        spec["deployments"] = [{"name": "LLMServer", "num_replicas": replicas}]
    schema = ServeDeploySchema.model_validate(
        {
            "http_options": {"host": "127.0.0.1", "port": ports.http},
            "grpc_options": grpc_options(ports.grpc),
            "applications": [spec],
        }
    )
    _get_global_client().deploy_apps(schema)

    def running() -> bool:
        app = serve.status().applications.get(NAME)
        return app is not None and str(getattr(app.status, "value", app.status)) == "RUNNING"

    wait_for(running, "the application to run", 180)
    return App(NAME, f"http://127.0.0.1:{ports.http}{PREFIX}", config.engine.model_name(), None)


@pytest.fixture(scope="module")
def app(serve_ports: ServePorts) -> Iterator[App]:
    from ray import serve

    app = _deploy(serve_ports)
    try:
        yield app
    finally:
        serve.delete(app.name)


def _running_replicas(app: App) -> int:
    from ray import serve

    status = serve.status().applications[app.name].deployments["LLMServer"]
    states = {str(getattr(k, "value", k)): v for k, v in status.replica_states.items()}
    return states.get("RUNNING", 0) if set(states) == {"RUNNING"} else -1


def _kill_under_load(
    app: App,
    ports: ServePorts,
    requests: list[LoadRequest],
    expected: list[str],
    which: str,
) -> dict:
    """Starts the load, SIGKILLs the busiest replica's `which` pid ("engine_pid" or "pid")
    once every stream is under way, and checks every request against its undisturbed text."""
    load = start_load(app, ports.grpc, requests)
    wait_for(lambda: load.streamed_progress() >= 4, "every stream to be under way", 120)
    victim = busiest_replica(app, 2)
    assert victim["num_requests_running"] > 0, victim
    kill_pid(victim[which])
    results = load.wait()
    assert pid_gone(victim[which])
    assert failures(results, expected) == []
    return victim


def _wait_replaced(app: App, victim: dict, replicas: int = 2) -> None:
    """Serve replaced the victim; every replica idle, no KV block held (nothing leaked)."""
    wait_for(lambda: _running_replicas(app) == replicas, "the replacement replica", 180)
    stats = wait_until_idle(app, replicas)
    assert victim["replica"] not in stats
    assert all(s["kv_blocks_used"] == 0 for s in stats.values()), stats


def _wait_restarted_in_place(app: App, victim: dict) -> float:
    """The victim replica (the same actor) serves again with a new engine child; every
    replica idle, no KV block held. Returns seconds from now until it was seen so."""
    t0 = time.monotonic()

    def restarted() -> bool:
        stats = replica_stats(app, 2)
        mine = stats.get(victim["replica"])
        return mine is not None and mine["engine_pid"] not in (None, victim["engine_pid"])

    wait_for(restarted, "the engine restarted in place", 120)
    took = time.monotonic() - t0
    stats = wait_until_idle(app, 2)
    assert stats[victim["replica"]]["pid"] == victim["pid"]  # not replaced: restarted
    assert all(s["kv_blocks_used"] == 0 for s in stats.values()), stats
    assert _running_replicas(app) == 2
    return took


def test_engine_process_killed(
    app: App, serve_ports: ServePorts, requests: list[LoadRequest], expected: list[str]
) -> None:
    victim = _kill_under_load(app, serve_ports, requests, expected, "engine_pid")
    _wait_restarted_in_place(app, victim)


def test_two_faults_one_second_apart(
    app: App, serve_ports: ServePorts, requests: list[LoadRequest], expected: list[str]
) -> None:
    """The idle replica's engine dies, and a second later the actor of the replica serving
    the streams: for a while no replica can take them. They wait for one (the first replica's
    engine, restarted in place) instead of spending their migrations, and finish exactly."""
    load = start_load(app, serve_ports.grpc, requests)
    wait_for(lambda: load.streamed_progress() >= 4, "every stream to be under way", 120)
    stats = replica_stats(app, 2)
    busy = max(stats.values(), key=lambda s: s["num_requests_running"])
    (idle,) = [s for s in stats.values() if s["replica"] != busy["replica"]]
    kill_pid(idle["engine_pid"])
    time.sleep(1.0)
    kill_pid(busy["pid"])
    results = load.wait()
    assert failures(results, expected) == []
    _wait_replaced(app, busy)


def test_replica_actor_killed(
    app: App, serve_ports: ServePorts, requests: list[LoadRequest], expected: list[str]
) -> None:
    victim = _kill_under_load(app, serve_ports, requests, expected, "pid")
    _wait_replaced(app, victim)
    # The moved requests found the blocks the dead replica published (its node's store
    # actor owns them): each pulled them or, measured cheaper, recomputed; none failed.
    share = [s["kv_share"] for s in replica_stats(app, 2).values()]
    assert sum(s["pulled"] + s["recompute"] for s in share) >= 1, share
    assert sum(s["failed"] + s["refused"] for s in share) == 0, share


def test_replica_removed_by_a_config_update(
    app: App, serve_ports: ServePorts, requests: list[LoadRequest], expected: list[str]
) -> None:
    _until_the_ingress_routes_to_both(app)
    load = start_load(app, serve_ports.grpc, requests)
    wait_for(lambda: load.streamed_progress() >= 4, "every stream to be under way", 120)
    before = replica_stats(app, 2)
    assert all(s["num_requests_running"] > 0 for s in before.values()), before
    # One replica fewer: Serve stops one; its requests run GRACE_S more, then move.
    _deploy(serve_ports, 1)
    results = load.wait()
    assert failures(results, expected) == []
    wait_for(lambda: _running_replicas(app) == 1, "the scale-down", 60)
    (left,) = wait_until_idle(app, 1).values()
    assert left["kv_blocks_used"] == 0


def _until_the_ingress_routes_to_both(app: App) -> None:
    """The previous test replaced a replica; the HTTP ingress's router learns of the new one a
    moment after Serve does. Short requests of varied prompts until both replicas served one,
    so the load below is spread over both (each must have streams for the one Serve stops)."""

    def served() -> dict[str, int]:
        return {r: s["generation_tokens"] for r, s in replica_stats(app, 2).items()}

    start, i = served(), 0
    with httpx.Client(timeout=60) as http:
        while sum(n > start.get(r, 0) for r, n in served().items()) < 2:
            assert i < 200, "the ingress never routed to both replicas"
            body = {"model": app.model, "prompt": [300 + i] * 20, "max_tokens": 1}
            assert http.post(f"{app.base_url}/v1/completions", json=body).status_code == 200
            i += 1


def test_tp_rank_killed(
    serve_ports: ServePorts, requests: list[LoadRequest], expected: list[str]
) -> None:
    from ray import serve

    config = _config(tensor_parallel_size=2)
    app = deploy("migration-tp", "/migration-tp", config, serve_ports, None)
    try:
        load = start_load(app, serve_ports.grpc, requests)
        wait_for(lambda: load.streamed_progress() >= 4, "every stream to be under way", 120)
        ranks = _rank_pids()
        assert len(ranks) == 4, ranks  # 2 replicas x 2 ranks
        kill_pid(ranks[-1])
        results = load.wait()
        assert failures(results, expected) == []
        stats = wait_until_idle(app, 1)
        assert all(s["kv_blocks_used"] == 0 for s in stats.values()), stats
    finally:
        serve.delete(app.name)


def _rank_pids() -> list[int]:
    """Processes of this Ray instance's live TP rank actors, from its GCS actor table (the
    processes Ray titles `ray::RankWorker...` on this machine may include another instance's:
    `make test`'s local part runs one beside this one, tests/conftest.py LOCAL_RAY)."""
    from ray._private import state

    return sorted(
        a["Pid"]
        for a in state.actors().values()
        if a["State"] == "ALIVE" and a["ActorClassName"] == "RankWorker"
    )


@pytest.fixture(scope="module")
def small_app(serve_ports: ServePorts) -> Iterator[App]:
    """Two replicas that run one sequence each and queue SMALL_QUEUE more; one migration.
    Its tests come after the TP test: while this app and the shared one are up, a TP = 2
    app's ranks find no CPU on a 2-core machine and its deploy waits for ever."""
    from ray import serve

    config = _config(max_migrations=1, max_num_seqs=1, max_queued_requests=SMALL_QUEUE)
    app = deploy("migration-small", "/migration-small", config, serve_ports, None)
    try:
        yield app
    finally:
        serve.delete(app.name)


SMALL_QUEUE = 4


def test_streams_within_the_queue_caps_get_no_429(small_app: App) -> None:
    """As many streams as both waiting queues hold, all at once and with one prompt prefix
    (the prefix-affinity router's favourite replica is the same for all): a replica whose
    queue is full gets no more while the other has room, so none is refused."""
    from concurrent.futures import ThreadPoolExecutor

    def stream(i: int) -> tuple[int, str]:
        body = {"model": small_app.model, "prompt": [500] * 20 + [600 + i], "max_tokens": 24}
        body |= {"ignore_eos": True, "temperature": 0.0, "stream": True}
        with httpx.Client(timeout=240) as http:
            r = http.post(f"{small_app.base_url}/v1/completions", json=body)
            return r.status_code, r.text

    with ThreadPoolExecutor(2 * SMALL_QUEUE) as pool:
        results = list(pool.map(stream, range(2 * SMALL_QUEUE)))
    bad = [(status, text[:300]) for status, text in results if status != 200 or "error" in text]
    assert bad == [], bad
    assert all(text.rstrip().endswith("data: [DONE]") for _, text in results)


def test_more_failures_than_max_migrations_is_a_clear_503(small_app: App) -> None:
    with httpx.Client(timeout=240) as http:
        body = {"model": small_app.model, "prompt": [400] * 8, "max_tokens": 600}
        body |= {"ignore_eos": True, "temperature": 0.0}
        pending = _post_soon(http, f"{small_app.base_url}/v1/completions", body)
        busy = lambda: busiest_replica(small_app, 2)["num_requests_running"] == 1  # noqa: E731
        wait_for(busy, "the request", 120)
        first = busiest_replica(small_app, 2)
        kill_pid(first["engine_pid"])
        # The second engine dies only once it has taken the migrated request: a refusal
        # by an engine that never took it is not charged (the request waits for a
        # replica instead), and the first replica restarts its engine in place.
        second = lambda: _running_elsewhere(small_app, first["replica"])  # noqa: E731
        wait_for(lambda: second() is not None, "the migrated request", 120)
        kill_pid(second()["engine_pid"])
        resp = pending()
    assert resp.status_code == 503, resp.text
    message = resp.json()["error"]["message"]
    assert "max_migrations=1" in message and "2 replicas" in message, message


def _running_elsewhere(app: App, replica: str) -> dict | None:
    """The stats of a replica other than `replica` that is running a request, if any."""
    for rid, stats in replica_stats(app, 2).items():
        if rid != replica and stats["num_requests_running"] > 0:
            return stats
    return None


def _post_soon(http: httpx.Client, url: str, body: dict) -> Callable[[], httpx.Response]:
    """POSTs on a thread; returns the function that waits for the response."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(1)
    fut = pool.submit(http.post, url, json=body)
    pool.shutdown(wait=False)
    return lambda: fut.result(timeout=240)

"""One Ray instance for the whole test session, and the order that lets every module share it.

`pytest tests` is one process, and one process holds at most one Ray connection: modules
cannot each `ray.init` their own instance while another is alive. So one session fixture,
`ray_session`, owns the only local Ray instance, started with everything any test needs from
it before its processes exist (the API key replicas read from their environment, kvray's
Serve settings, a free metrics export port publishing every second); `serve_ports` starts
Serve on it once. Every Ray test uses these; none calls `ray.init` or `serve.start`.

`make test` runs the suite as two pytest processes at once (`--part`): every test that needs
no shared Ray (those that start a Ray of their own, OWN_RAY, among them) beside every test
that shares it. The Ray tests spend much of their time waiting on deploys, streams and
metrics exports: the others fill those waits on a small machine.

A few modules need something of the shared instance that others would spoil, so the
collection hook below runs them first, in this order, after every test that needs no Ray
(those then run without idle Ray processes beside them):

- tests/monitoring/test_prometheus_live.py reads cluster-wide sums (every request's tokens,
  the number of LLMServer replicas): no other kvray application may have run before it.
- tests/cluster/grpc_api/test_grpc_{answers,errors,lifecycle}.py bind Serve's gRPC port
  (`grpc_options.port`, where GrpcIngress listens) through one app shared by the three
  (their package-scoped fixtures): another kvray application deployed meanwhile would share
  the port through SO_REUSEPORT and answer half of its calls. Lifecycle stops the app: last.
- tests/workers/test_tensor_parallel.py needs no Serve: its CPU-heavy gloo ranks run before
  the shared apps' replicas are up beside them.

A few self-contained Ray modules (LOCAL_RAY: their own apps, nothing of `kvray_app`, nothing
cluster-wide) run in the local part instead, after its other tests, on a Ray instance of that
process's own (its `ray_session`, started when the first of them runs): the Ray part is the
longer of the two, and these balance them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# kvray's Triton kernels run on a CPU-only machine through Triton's interpreter, which Triton
# reads when a kernel is defined: set it before any test imports one (tests/triton_interpret.py).
# On a machine with an NVIDIA device (tests/gpu) they run compiled.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cluster.cli.local_ray import init_local_ray
from tests.cluster.serve_helpers import RAY_ENV, RaySession, ServePorts, free_port

REPO = Path(__file__).resolve().parents[1]

# Modules run first among those that use Ray, in this order (see the module docstring).
RAY_FIRST = (
    "tests/monitoring/test_prometheus_live.py",
    "tests/cluster/grpc_api/test_grpc_answers.py",
    "tests/cluster/grpc_api/test_grpc_errors.py",
    "tests/cluster/grpc_api/test_grpc_lifecycle.py",
    "tests/workers/test_tensor_parallel.py",
)
# Tests that start a Ray instance of their own (`kvray serve`, `kvray run-batch`, `ray start`),
# whole modules or single tests: they need nothing of the session's instance and run beside
# it, in the local part, one after another (a local instance binds Serve's fixed HAProxy ports).
OWN_RAY = (
    "tests/cluster/cli/test_serve_tls.py",
    "tests/cluster/test_migration_multinode.py",
    "tests/cluster/cli/test_serve.py::"
    "test_after_rays_processes_are_killed_the_next_serve_starts_and_drains_on_sigterm",
    "tests/cluster/cli/test_run_batch.py::"
    "test_without_a_url_it_starts_kvray_answers_and_leaves_nothing_running",
    "tests/cluster/bench/kv_tier/test_main.py::test_every_arm_runs_and_matches",
)
# Modules that use `ray_session` but run in the local part, last, on its own Ray instance
# (see the module docstring): none uses `kvray_app` (the local part would deploy it again),
# reads cluster-wide sums or counts processes of the whole machine; their apps, one at a time,
# have that instance's Serve gRPC port to themselves. In one process (--part all) they run
# among the other Ray tests.
LOCAL_RAY = (
    "tests/cluster/controller/test_autoscaling_live.py",
    "tests/cluster/test_unhappy_paths.py",
    "tests/cluster/bench/chaos/test_main.py",
    "tests/cluster/bench/fault/test_main.py",
    "tests/cluster/test_pd.py",
)
PARTS = ("all", "local", "ray")
# Ray's agent publishes every second (default 10 s): metrics tests wait on it.
METRICS_REPORT_INTERVAL_MS = 1000


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--part",
        choices=PARTS,
        default="all",
        help="local: only the tests that need no shared Ray instance; ray: only the others "
        "(they share the session's one Ray instance); all: both, in one process",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests without the session's Ray first, then the Ray tests of RAY_FIRST's modules, then
    the other Ray tests; `--part local` keeps the first group, `--part ray` the others.

    A test is a Ray test when it uses `ray_session`, directly or not; the OWN_RAY tests count
    as tests without it. The others of a Ray module (flags, reports, one-process parity) run
    in the local part: the Ray part, the longer of the two, keeps only what needs it. The Ray
    tests of a module keep their order and share its fixtures. LOCAL_RAY's modules are Ray
    tests of the local part: they run after its other tests (by rank), on its own instance.
    """

    def rank(item: pytest.Item) -> int:
        if "ray_session" not in getattr(item, "fixturenames", ()) or _own_ray(item):
            return 0
        path = _relpath(item)
        return 1 + (RAY_FIRST.index(path) if path in RAY_FIRST else len(RAY_FIRST))

    def in_ray_part(item: pytest.Item) -> bool:
        return rank(item) > 0 and _relpath(item) not in LOCAL_RAY

    part = config.getoption("part")
    if part != "all":
        keep = [item for item in items if in_ray_part(item) == (part == "ray")]
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep
    items.sort(key=rank)  # stable: the collection order within each rank


def _own_ray(item: pytest.Item) -> bool:
    return any(item.nodeid == t or item.nodeid.startswith(f"{t}::") for t in OWN_RAY)


def _relpath(item: pytest.Item) -> str:
    return item.path.resolve().relative_to(REPO).as_posix()


@pytest.fixture(scope="session")
def demo_dir() -> Path:
    from workers.demo import demo_model_dir

    return demo_model_dir()


@pytest.fixture(scope="session")
def ray_session(demo_dir: Path) -> Iterator[RaySession]:
    """The session's local Ray instance. The demo checkpoint is built first, once, here:
    replicas starting together would otherwise race to write it."""
    import ray

    # Imported before kvray's Serve settings are applied: this process keeps Serve's defaults,
    # so its handles route on Serve's own loop and work from sync code and asyncio.run alike.
    from ray import serve

    from cluster.deploy.serve_env import LOCAL_SERVE_ENV, SERVE_ENV, apply_serve_env

    # A local Ray instance's processes inherit this process's environment when it starts:
    # the API key the test apps read, and kvray's Serve settings. KVRAY_API_KEY must not leak
    # in from the shell: apps deployed with the default api_key_env would require a key.
    # Serve's HAProxy also listens on two fixed ports of all interfaces (stats 8404, its
    # metrics 9101): free ones here, so that a run never collides with another one, or with
    # an HAProxy a killed run left behind (it outlives its Ray instance).
    haproxy_ports = {
        "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
    }
    keys = (*RAY_ENV, *haproxy_ports, "KVRAY_API_KEY", *SERVE_ENV, *LOCAL_SERVE_ENV)
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(RAY_ENV)  # before apply_serve_env: its defaults do not override these
    os.environ.update(haproxy_ports)
    os.environ.pop("KVRAY_API_KEY", None)
    apply_serve_env()
    env_vars = {}
    try:
        import kvray.v1  # noqa: F401
    except ImportError:
        # Until the gRPC stubs are installed as the `kvray` package, put them on the path.
        env_vars["PYTHONPATH"] = str(REPO / "proto")
    metrics_port = free_port()
    _poll_serve_status_often()
    init_local_ray(  # tried again when Ray's node misses its start-up deadline (a busy machine)
        address="local",  # our own instance, even if someone's `ray start` cluster is up
        num_cpus=8,
        include_dashboard=False,
        logging_level="WARNING",
        runtime_env={"env_vars": env_vars} if env_vars else None,
        _metrics_export_port=metrics_port,
        _system_config={"metrics_report_interval_ms": METRICS_REPORT_INTERVAL_MS},
    )
    try:
        yield RaySession(metrics_url=f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        serve.shutdown()
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# How often this process's Serve client polls the controller while `serve.run` waits for an
# application to run and `serve.delete` for it to go (Serve's default: every second). A poll is
# one status call to the controller, which acts on the change in its own loop (0.1 s): each
# deploy and delete would otherwise wait half a second longer, on average, than it takes.
SERVE_CLIENT_POLL_S = 0.1


def _poll_serve_status_often() -> None:
    from ray.serve._private import client

    # The client module reads the constant at each poll (imported by name from Serve's
    # constants); a Ray version without it keeps its own interval.
    if hasattr(client, "CLIENT_POLLING_INTERVAL_S"):
        client.CLIENT_POLLING_INTERVAL_S = SERVE_CLIENT_POLL_S


@pytest.fixture(scope="session")
def serve_ports(ray_session: RaySession) -> ServePorts:
    """Serve on the session's Ray instance, on free ports (never Serve's defaults: other runs
    may be on the same machine). Apps are deployed and deleted by the fixtures using them."""
    from ray import serve

    from cluster.grpc_api.ingress import grpc_options

    ports = ServePorts(http=free_port(), grpc=free_port())
    serve.start(
        http_options={"host": "127.0.0.1", "port": ports.http},
        grpc_options=grpc_options(ports.grpc),
    )
    return ports

"""One Ray instance and one Serve instance for every cluster test module (session fixtures).

Ray and Serve take tens of seconds to start on a small machine, so they start once per
session on free ports (never Serve's defaults: other runs may be on the same machine). Apps
are deployed by the fixtures that need them, each under its own route prefix, and deleted
when done. `kvray_app` is the shared main app: 2 LLMServer replicas of the demo model behind
the prefix-affinity router, with an API key.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.serve_env import LOCAL_SERVE_ENV, SERVE_ENV, apply_serve_env
from tests.cluster.serve_helpers import (
    API_KEY,
    API_KEY_ENV,
    KV_CACHE_BYTES,
    App,
    ServePorts,
    deploy,
    free_port,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def demo_dir() -> Path:
    from workers.demo import demo_model_dir

    return demo_model_dir()


@pytest.fixture(scope="session")
def ray_session(demo_dir: Path) -> Iterator[None]:
    import ray

    # Replicas read the API key from their environment, which a local Ray instance inherits
    # from this process when it starts. KVRAY_API_KEY must not leak in from the shell: apps
    # deployed with the default api_key_env would suddenly require a key.
    saved = {
        k: os.environ.get(k) for k in (API_KEY_ENV, "KVRAY_API_KEY", *SERVE_ENV, *LOCAL_SERVE_ENV)
    }
    os.environ[API_KEY_ENV] = API_KEY
    os.environ.pop("KVRAY_API_KEY", None)
    # The Ray processes run with kvray's Serve settings; this process read Serve's defaults
    # when the test modules imported it, so its own handles keep their router on a separate
    # loop (the tests call them both synchronously and from asyncio.run).
    apply_serve_env()
    env_vars = {}
    try:
        import kvray.v1  # noqa: F401
    except ImportError:
        # Until the gRPC stubs are installed as the `kvray` package, put them on the path.
        env_vars["PYTHONPATH"] = str(REPO / "proto")
    ray.init(
        address="local",  # our own instance, even if someone's `ray start` cluster is up
        num_cpus=8,
        include_dashboard=False,
        logging_level="WARNING",
        runtime_env={"env_vars": env_vars} if env_vars else None,
    )
    try:
        yield
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def serve_ports(ray_session: None) -> ServePorts:
    from ray import serve

    from cluster.grpc_api.ingress import grpc_options

    ports = ServePorts(http=free_port(), grpc=free_port())
    serve.start(
        http_options={"host": "127.0.0.1", "port": ports.http},
        grpc_options=grpc_options(ports.grpc),
    )
    return ports


@pytest.fixture(scope="session")
def kvray_app(serve_ports: ServePorts) -> Iterator[App]:
    from ray import serve

    from cluster.config import ServeConfig

    config = ServeConfig(
        num_replicas=2,
        api_key_env=API_KEY_ENV,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        max_num_seqs=32,
    )
    app = deploy("kvray-main", "/main", config, serve_ports, API_KEY)
    yield app
    serve.delete(app.name)

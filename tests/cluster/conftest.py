"""The shared main app of the cluster tests.

Ray and Serve start once per session (`ray_session`, `serve_ports` in tests/conftest.py).
Apps are deployed by the fixtures that need them, each under its own route prefix, and
deleted when done. `kvray_app` is the shared main app: 2 LLMServer replicas of the demo model
behind the prefix-affinity router, with an API key and the qwen3 reasoning parser.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.cluster.serve_helpers import (
    API_KEY,
    API_KEY_ENV,
    KV_CACHE_BYTES,
    App,
    ServePorts,
    deploy,
)


@pytest.fixture(scope="session")
def kvray_app(serve_ports: ServePorts) -> Iterator[App]:
    from ray import serve

    from cluster.config import ServeConfig

    config = ServeConfig.from_flat(
        num_replicas=2,
        api_key_env=API_KEY_ENV,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        max_num_seqs=32,
        # Answers that do not open <think> are unchanged (see test_reasoning_live.py).
        reasoning_parser="qwen3",
    )
    app = deploy("kvray-main", "/main", config, serve_ports, API_KEY)
    yield app
    serve.delete(app.name)

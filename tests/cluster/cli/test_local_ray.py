"""init_local_ray: a start that misses Ray's node deadline is cleaned up and tried again.

Ray's timeout cannot be produced on demand, so `init` stands in for a `ray.init` that starts
a real process and then fails as Ray does; the retry and the clean-up are real."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cluster.cli.local_ray import init_local_ray

RAY_TIMEOUT = (
    "The current node timed out during startup. This could happen because some of the raylet "
    "failed to startup or the GCS has become overloaded."
)


class FlakyStart:
    """Starts a child process each call (a raylet, say); fails the first `fail` calls."""

    def __init__(self, fail: int, error: str = RAY_TIMEOUT) -> None:
        self.fail, self.error = fail, error
        self.calls: list[dict] = []
        self.children: list[subprocess.Popen] = []

    def __call__(self, **kwargs: object) -> None:
        self.calls.append(kwargs)
        self.children.append(
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        )
        if len(self.calls) <= self.fail:
            raise Exception(self.error)

    def stop(self) -> None:
        for child in self.children:
            child.kill()
            child.wait()


def test_a_timed_out_start_is_stopped_and_started_again() -> None:
    start = FlakyStart(fail=1)
    try:
        init_local_ray(init=start, address="local", num_cpus=2)
        assert start.calls == [{"address": "local", "num_cpus": 2}] * 2
        assert start.children[0].wait(timeout=30) is not None  # what the failed start left
        assert start.children[1].poll() is None  # what the second start runs stays up
    finally:
        start.stop()


def test_it_gives_up_after_the_last_attempt_with_rays_error() -> None:
    start = FlakyStart(fail=5)
    try:
        with pytest.raises(Exception, match="timed out during startup"):
            init_local_ray(attempts=2, init=start)
        assert len(start.calls) == 2
    finally:
        start.stop()


def test_any_other_error_is_raised_at_once() -> None:
    start = FlakyStart(fail=1, error="port 8080 is taken")
    try:
        with pytest.raises(Exception, match="port 8080"):
            init_local_ray(init=start)
        assert len(start.calls) == 1
    finally:
        start.stop()

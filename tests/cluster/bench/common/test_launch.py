"""The --launch app's settings checked before any Ray starts (cluster/bench/common/launch.py)."""

from __future__ import annotations

import argparse

import pytest

from cluster.bench.common.launch import add_arguments, launch_error


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_valid_caps_pass() -> None:
    assert launch_error(_args()) is None
    assert launch_error(_args("--max-queued-requests", "4", "--max-ongoing-requests", "2")) is None


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (("--max-queued-requests", "-1"), "max_queued_requests"),
        (("--max-ongoing-requests", "0"), "max_ongoing_requests"),
        (("--num-replicas", "-2"), "num_replicas"),
    ],
)
def test_a_bad_cap_is_named_before_ray_starts(argv: tuple[str, ...], field: str) -> None:
    err = launch_error(_args(*argv))
    assert err is not None and field in err


def test_the_bench_refuses_it_with_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    from cluster.cli.main import main

    argv = ["bench", "serve", "--launch", "--backend", "http", "--max-queued-requests", "-1"]
    assert main(argv) == 2
    assert "max_queued_requests" in capsys.readouterr().err

"""`kvray serve --log-level`: what each level shows on the console, and which of Ray's and
Serve's forwarded lines the default keeps off it (lines as a real start-up prints them)."""

from __future__ import annotations

import argparse
import logging

import pytest

from cluster.cli import serve as serve_cmd
from cluster.cli.console import console_logging, filtered, line_level, shown

SERVE_INFO = (
    "INFO 2026-12-05 14:35:46,664 controller 12567 -- HAProxy is enabled in ServeController"
)
SERVE_WARNING = "WARNING 2026-12-05 14:35:46,664 controller 12567 -- HTTPOptions.host='127.0.0.1'"
ENGINE_INFO = "2026-12-05 14:35:56,230 INFO engine-process rank 0/1: loaded Qwen3ForCausalLM"
RAY_WARNING = "2026-12-05 14:35:42,358\tWARNING authentication_token_setup.py:85 -- Token auth"
REPLICA_ERROR = "ERROR 2026-12-05 14:36:02,333 kvray_LLMServer z3jlz5za -- engine died"
TRACEBACK = "Traceback (most recent call last):"


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_cmd.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_default_is_kvrays_info_and_everyone_elses_warnings() -> None:
    levels = console_logging(_parse().log_level)
    assert levels.kvray == logging.INFO
    assert levels.ray_driver == levels.serve_driver == levels.forwarded == logging.WARNING


def test_debug_maps_to_the_verbose_settings() -> None:
    levels = console_logging(_parse("--log-level", "debug").log_level)
    assert levels.kvray == logging.DEBUG
    assert levels.ray_driver == levels.serve_driver == logging.INFO  # Ray's own defaults
    assert levels.forwarded == logging.NOTSET  # every forwarded line
    assert all(shown(x, levels.forwarded) for x in (SERVE_INFO, ENGINE_INFO))


def test_error_hides_warnings_too_and_unknown_levels_are_refused() -> None:
    levels = console_logging(_parse("--log-level", "error").log_level)
    assert levels.kvray == levels.forwarded == logging.ERROR
    assert not shown(SERVE_WARNING, levels.forwarded) and shown(REPLICA_ERROR, levels.forwarded)
    with pytest.raises(SystemExit):
        _parse("--log-level", "verbose")


def test_line_levels_of_serves_rays_and_the_engines_formats() -> None:
    assert [line_level(x) for x in (SERVE_INFO, SERVE_WARNING, ENGINE_INFO, RAY_WARNING)] == [
        logging.INFO, logging.WARNING, logging.INFO, logging.WARNING,
    ]  # fmt: skip
    # No level: a traceback, a print, a raylet message always show.
    assert line_level(TRACEBACK) is None and line_level("INFO is a word") is None


def test_forwarded_batches_keep_warnings_errors_and_lines_without_a_level() -> None:
    got: list[dict] = []
    handle = filtered(got.append, logging.WARNING)
    handle({"pid": 1, "lines": [SERVE_INFO, ENGINE_INFO]})  # nothing left: nothing printed
    handle({"pid": 2, "lines": [SERVE_INFO, REPLICA_ERROR, TRACEBACK, SERVE_WARNING]})
    assert got == [{"pid": 2, "lines": [REPLICA_ERROR, TRACEBACK, SERVE_WARNING]}]


def test_banner_names_the_logs_directory() -> None:
    args = _parse()
    text = serve_cmd.banner(serve_cmd.config_from_flags(args), args, False, "/tmp/ray/s/logs")
    assert "logs       : /tmp/ray/s/logs" in text

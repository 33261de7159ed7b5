"""What `kvray serve` shows on its console (--log-level), and where Ray's and Serve's own
logs go instead.

By default the console shows kvray's own progress, the URLs, and every warning and error;
Ray's and Serve's INFO lines (HAProxy reloads, endpoint tables, replica start-up, access
logs) stay in their log files, under the Ray session's logs directory. Three sources:

- Ray's processes (Serve's controller, proxies, replicas, engines) write to their own log
  files; Ray forwards each line to the driver's console as well (ray.init's log_to_driver),
  prefixed "(Name pid=N)". The driver drops forwarded lines below a level here (a line with
  no level, such as a traceback or a print, always shows); the files keep every line.
- This process's Serve logger ("ray.serve": "Started Serve", "Deployed app", "Deleting app")
  logs to the console only; its console handler gets the level, and a file in the session's
  Serve log directory gets its INFO lines.
- Ray's own driver logger: ray.init(logging_level=...).

--log-level debug shows everything on the console, as Ray and Serve do by default.

Imported by `kvray --help`: nothing heavy (no ray) at module level.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cluster.ray_internals import session_logs_dir, wrap_forwarded_log_printer

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_LEVEL_HELP = (
    "what the console shows: info (default) = kvray's progress, the URLs, warnings and "
    "errors; Ray's and Serve's INFO lines go to their log files (the path is printed at "
    "start-up); debug = also kvray's debug lines and all of Ray's and Serve's output; "
    "warning / error = only those"
)
# Where Ray's logs are when the session's own directory cannot be asked for.
DEFAULT_LOGS_DIR = "/tmp/ray/session_latest/logs"

# The level of a log line as Serve writes it ("INFO 2026-01-01 12:00:00,000 controller ...")
# or as the logging module's "%(asctime)s %(levelname)s" formats do ("2026-01-01 12:00:00,000
# INFO engine-process ...", Ray's "2026-01-01 12:00:00,000\tWARNING file.py:85 -- ...").
_LEVEL_NAMES = "DEBUG|INFO|WARNING|ERROR|CRITICAL"
_LINE_LEVEL = re.compile(
    rf"^(?:(?P<first>{_LEVEL_NAMES}) \d{{4}}-\d\d-\d\d |"
    rf"\[?\d{{4}}-\d\d-\d\d[ T][\d:.,]+\]?\s+(?P<second>{_LEVEL_NAMES})\b)"
)


@dataclass(frozen=True)
class ConsoleLogging:
    """The levels one --log-level sets (logging module levels)."""

    kvray: int  # kvray's own loggers in this process
    ray_driver: int  # Ray's driver logger: ray.init(logging_level=...)
    serve_driver: int  # the console handler of this process's Serve logger
    forwarded: int  # the lowest level of Ray's processes' lines shown (0: every line)


def console_logging(level: str) -> ConsoleLogging:
    if level not in LOG_LEVELS:
        raise ValueError(f"log level {level!r}: choose from {', '.join(LOG_LEVELS)}")
    if level == "debug":
        return ConsoleLogging(logging.DEBUG, logging.INFO, logging.INFO, logging.NOTSET)
    own = logging.getLevelName(level.upper())
    quiet = max(own, logging.WARNING)
    return ConsoleLogging(own, quiet, quiet, quiet)


def line_level(line: str) -> int | None:
    """The level a log line names at its start; None for anything else."""
    m = _LINE_LEVEL.match(line)
    if not m:
        return None
    return logging.getLevelName(m.group("first") or m.group("second"))


def shown(line: str, threshold: int) -> bool:
    level = line_level(line)
    return level is None or level >= threshold


def filtered(handler: Callable[[dict[str, Any]], None], threshold: int) -> Callable[..., None]:
    """A handler of Ray's forwarded log batches that passes `handler` only the lines shown."""

    def handle(data: dict[str, Any]) -> None:
        lines = [x for x in data.get("lines") or () if shown(x, threshold)]
        if lines:
            handler({**data, "lines": lines})

    return handle


def filter_forwarded_logs(threshold: int) -> bool:
    """After ray.init: the lines Ray's processes forward to this console below `threshold`
    are left out (they stay in the processes' log files). Whether the filter is in place
    (it relies on Ray's driver-side log dispatcher: cluster/ray_internals.py)."""
    if threshold <= logging.NOTSET:
        return True
    return wrap_forwarded_log_printer(lambda handler: filtered(handler, threshold))


def ray_logs_dir() -> str:
    """The running Ray session's logs directory (Serve's are in its serve/)."""
    return session_logs_dir() or DEFAULT_LOGS_DIR


def quiet_serve_driver_logger(levels: ConsoleLogging, logs_dir: str) -> str | None:
    """This process's Serve logger: its console handler at levels.serve_driver, and (when
    that hides its INFO lines) a file in Serve's log directory that keeps them. The file's
    path, if one was opened. Call after `import ray.serve` (which sets the logger up)."""
    serve_logger = logging.getLogger("ray.serve")
    for handler in serve_logger.handlers:
        if type(handler) is logging.StreamHandler:
            handler.setLevel(levels.serve_driver)
    if levels.serve_driver <= logging.INFO:
        return None
    path = os.path.join(logs_dir, "serve", f"kvray_serve_driver_{os.getpid()}.log")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        file_handler = logging.FileHandler(path)
    except OSError:
        return None
    file_handler.setLevel(logging.INFO)
    file_handler.setFormatter(
        logging.Formatter("%(levelname)s %(asctime)s %(name)s %(process)d -- %(message)s")
    )
    serve_logger.addHandler(file_handler)
    return path

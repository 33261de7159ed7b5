"""Ctrl-C and SIGTERM for `kvray serve`, from its first step to its last.

The handler only records the signal; the command checks it between steps. An exception
raised from a handler lands wherever the main thread happens to be, inside Ray's client
code too, where it can leave a lock taken or a call half made, and the clean-up that
follows then hangs. A second signal exits at once: the user asked twice.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

# How often a wait (the deploy, the serving loop) looks at the signal and at Serve.
POLL_S = 0.5


class StartInterrupted(Exception):
    """A signal arrived while Ray started or the application deployed."""


class StopSignals:
    """Records SIGINT/SIGTERM in an Event; `install` again after something (ray.init)
    replaced the handlers."""

    def __init__(self) -> None:
        self.received = threading.Event()

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)

    def check(self) -> None:
        """Raises StartInterrupted once a signal has arrived."""
        if self.received.is_set():
            raise StartInterrupted

    def wait(self, timeout_s: float) -> bool:
        """Whether a signal arrived within timeout_s (woken by it at once)."""
        return self.received.wait(timeout_s)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        # No logging here: the main thread may hold the logging lock the handler would need.
        if self.received.is_set():
            os._exit(128 + signum)
        self.received.set()


def deploy(targets: Sequence[Any], signals: StopSignals) -> None:
    """Deploys Serve applications (`ray.serve.RunTarget`s) as `serve.run_many` does, waiting
    until each is RUNNING and Serve's proxies route to it, and raises StartInterrupted as
    soon as a signal arrives. The deploy runs in a thread of its own: the signal is checked
    here meanwhile (the caller then deletes the applications; the thread ends with them)."""
    from ray import serve

    failures: list[BaseException] = []

    def run() -> None:
        try:
            serve.run_many(targets)
        except BaseException as err:  # handed to the caller
            failures.append(err)

    worker = threading.Thread(target=run, name="kvray-deploy", daemon=True)
    worker.start()
    while worker.is_alive():
        signals.check()
        worker.join(POLL_S)
    if failures:
        raise failures[0]

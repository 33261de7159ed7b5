"""Engine restart in place: a replica whose engine child died starts a new one itself.

Replacing the whole replica (Serve's answer to an unhealthy one) costs a new actor, a new
placement and a new process before the weights even load; the replica's own child process
can be started again in the time the load takes. So when the engine child of a replica dies,
`EngineSupervisor` starts a new engine with the same config, and meanwhile the replica
refuses requests as "not taken" (the ingress waits for or moves them without charging a
migration, cluster/ingress/migration.py) and reports itself not alive to the routers.

A replica whose engine keeps dying is not saved: after `max_restarts` restarts within
`window_s` it gives up and its health check fails, so Serve replaces it. Only a process
engine is restarted: an in-process engine (a thread core, TP > 1 with Ray actor ranks) fails
the health check at once, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("ray.serve.kvray.llm_server")

DEFAULT_MAX_RESTARTS = 3
DEFAULT_RESTART_WINDOW_S = 300.0
# How often the supervisor looks at the engine: a death is noticed within this.
POLL_S = 0.2


class EngineSupervisor:
    """Owns a replica's engine: `engine` is the current one; `run()` watches it forever."""

    def __init__(
        self,
        start: Callable[[], Any],
        engine: Any,
        max_restarts: int = DEFAULT_MAX_RESTARTS,
        window_s: float = DEFAULT_RESTART_WINDOW_S,
        on_restart: Callable[[Any], None] | None = None,
    ) -> None:
        self._start = start  # builds a new engine (blocking: run on a worker thread)
        self.engine = engine
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._on_restart = on_restart  # called with the new engine, on the event loop
        self._restarts: deque[float] = deque()
        self.restarting = False
        self.last_restart_s: float | None = None  # seconds the last restart took

    @property
    def gave_up(self) -> bool:
        """The engine is dead and restarting it again is not allowed (or not possible)."""
        return not self.engine.healthy and not self.restarting and not self._may_restart()

    def _may_restart(self) -> bool:
        if self.engine.in_process:
            return False  # a thread core (TP > 1): its ranks are Ray actors Serve replaces
        now = time.monotonic()
        while self._restarts and now - self._restarts[0] > self.window_s:
            self._restarts.popleft()
        return len(self._restarts) < self.max_restarts

    async def run(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            if not self.engine.healthy and not self.restarting and self._may_restart():
                await self.restart()

    async def restart(self) -> None:
        self.restarting = True
        old = self.engine
        self._restarts.append(time.monotonic())
        t0 = time.monotonic()
        logger.warning(
            "engine died (restart %d of at most %d in %.0f s): starting a new one",
            len(self._restarts),
            self.max_restarts,
            self.window_s,
        )
        try:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(old.shutdown)
            self.engine = await asyncio.to_thread(self._start)
            self.last_restart_s = time.monotonic() - t0
            if self._on_restart is not None:
                self._on_restart(self.engine)
            logger.warning("engine restarted in %.1f s", self.last_restart_s)
        except Exception:
            # The next poll tries again while restarts are left; then the health check fails.
            logger.exception("starting a new engine failed")
        finally:
            self.restarting = False

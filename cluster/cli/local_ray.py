"""The local Ray instance of `kvray serve` and `kvray run-batch`, started with one more try
when its node misses Ray's start-up deadline.

Ray gives a new node's raylet a fixed 30 s (not configurable) to register with the GCS. On a
small machine that is busy (a build or a test suite beside it) a first start can miss that
and raise. The processes it started are then nobody's: the failed `ray.init` keeps no handle
on them. So the processes that appeared under this one during the failed start are stopped,
and Ray is started once more; any other error is raised as it is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from cluster.cli.ports import stop_processes

logger = logging.getLogger("kvray.serve")

# What Ray's error says when the node did not register in time (ray/_private/node.py).
NODE_TIMEOUT_TEXT = "timed out during startup"
ATTEMPTS = 2


def init_local_ray(
    attempts: int = ATTEMPTS, init: Callable[..., Any] | None = None, **kwargs: Any
) -> None:
    """`ray.init(**kwargs)` (or `init`: the tests' stand-in for a start that times out),
    tried up to `attempts` times while it fails with Ray's node start-up timeout."""
    import psutil
    import ray

    me = psutil.Process()
    for attempt in range(1, attempts + 1):
        before = {p.pid for p in me.children(recursive=True)}
        try:
            (init or ray.init)(**kwargs)
            return
        except Exception as err:
            if NODE_TIMEOUT_TEXT not in str(err) or attempt == attempts:
                raise
            left = [p for p in me.children(recursive=True) if p.pid not in before]
            logger.warning(
                "Ray's node did not start within Ray's 30 s (a busy machine?): stopping the "
                "%d process(es) it started and starting it again",
                len(left),
            )
            stop_processes(left)  # ray.init had not got as far as recording a node

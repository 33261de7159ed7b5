"""`kvray serve`'s start-up port check, and Serve's HAProxy processes left behind.

Serve's HAProxy is a child of the HAProxyManager actor (`ray::HAProxyManager`); when Ray's
processes are killed (`ray stop --force`, a crash) it is reparented and keeps every port it
held. kvray serve stops, before starting, only those that are certainly such orphans: an
`haproxy` process of this user whose command line names a config file under Serve's config
directory (RAY_SERVE_HAPROXY_CONFIG_FILE_LOC's, /tmp/haproxy-serve by default) and whose
parent is not a Ray worker; and only when it holds a port this start needs. Anything else
holding a port is named in a one-line error.

Imported by `kvray serve` before Ray: psutil only (a Ray dependency), nothing heavy.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from dataclasses import dataclass

import psutil

logger = logging.getLogger("kvray.serve")

_DEFAULT_HAPROXY_CONFIG = "/tmp/haproxy-serve/haproxy.cfg"  # Serve's default
_STOP_WAIT_S = 5.0


@dataclass(frozen=True)
class Listener:
    what: str  # "HTTP", "gRPC", ... (for the error message)
    port: int


def port_in_use(port: int) -> bool:
    """Whether binding `port` on every interface fails: someone listens on it (on any
    address; SO_REUSEPORT listeners included, since this socket does not set it)."""
    with socket.socket() as s:
        # Connections of a previous run in TIME_WAIT do not make a port taken.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def holders(port: int) -> list[psutil.Process]:
    """The processes listening on `port` that this user may inspect (others' are hidden)."""
    pids: set[int] = set()
    try:
        conns = psutil.net_connections(kind="inet")
    except (psutil.AccessDenied, OSError):
        return []
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            pids.add(c.pid)
    procs = []
    for pid in sorted(pids):
        try:
            procs.append(psutil.Process(pid))
        except psutil.Error:
            pass
    return procs


def haproxy_config_dir() -> str:
    """Where Serve writes its HAProxy configs (per node: DIR/NODE_ID/haproxy.cfg)."""
    path = os.environ.get("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC") or _DEFAULT_HAPROXY_CONFIG
    return os.path.dirname(path)


def serve_haproxies(config_dir: str | None = None) -> list[psutil.Process]:
    """This user's HAProxy processes running a Serve config from `config_dir`."""
    return [p for p in psutil.process_iter() if _is_serve_haproxy(p, config_dir)]


def _is_serve_haproxy(proc: psutil.Process, config_dir: str | None = None) -> bool:
    prefix = (config_dir or haproxy_config_dir()).rstrip("/") + "/"
    try:
        if "haproxy" not in proc.name() or proc.uids().real != os.getuid():
            return False
        return any(arg.startswith(prefix) for arg in proc.cmdline())
    except psutil.Error:  # gone, or not ours to inspect
        return False


def is_serve_haproxy_orphan(proc: psutil.Process) -> bool:
    """A Serve HAProxy whose manager actor is gone (its parent is no `ray::` process)."""
    if not _is_serve_haproxy(proc):
        return False
    try:
        parent = proc.parent()
        return parent is None or not " ".join(parent.cmdline()).startswith("ray::")
    except psutil.NoSuchProcess:
        return True
    except psutil.AccessDenied:  # a parent we may not inspect is no Ray worker of ours
        return True


def stop_processes(procs: list[psutil.Process]) -> None:
    """SIGTERM, then SIGKILL what is still running after a few seconds."""
    for proc in procs:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=_STOP_WAIT_S)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=_STOP_WAIT_S)


def describe(proc: psutil.Process) -> str:
    try:
        cmd = " ".join(proc.cmdline()) or proc.name()
    except psutil.Error:
        return f"pid {proc.pid}"
    return f"pid {proc.pid} ({cmd[:100]})"


def check_ports(listeners: list[Listener]) -> str | None:
    """None if every port is free (after stopping Serve HAProxy orphans holding one), else a
    one-line message naming the first taken port and what holds it, if this user can see."""
    for listener in listeners:
        if not port_in_use(listener.port):
            continue
        procs = holders(listener.port)
        orphans = [p for p in procs if is_serve_haproxy_orphan(p)]
        if orphans:
            for p in orphans:
                logger.warning(
                    "stopping %s: Serve's HAProxy left behind by a Ray instance that is gone, "
                    "holding the %s port %d",
                    describe(p),
                    listener.what,
                    listener.port,
                )
            stop_processes(orphans)
            if not port_in_use(listener.port):
                continue
            procs = holders(listener.port)
        held_by = f" by {', '.join(describe(p) for p in procs)}" if procs else ""
        return f"{listener.what} port {listener.port} is already in use{held_by}"
    return None

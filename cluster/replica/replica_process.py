"""Where an engine replica runs: its Serve replica id, its Ray node, the CPUs it reserved.

Kept apart from llm_server.py: these ask Ray and torch about the process, not the engine.
"""

from __future__ import annotations

import os


def replica_name() -> str:
    """This replica's Serve id (the `replica` metric label), or "local" outside Serve."""
    from ray import serve

    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve (unit use): one unnamed replica
        return "local"


def node_id() -> str | None:
    import ray

    try:
        return ray.get_runtime_context().get_node_id()
    except Exception:  # outside Ray (unit use)
        return None


def use_reserved_cpus(threads: int) -> None:
    """torch threads = the CPUs this replica reserved, here and in the engine child.

    Ray sets OMP_NUM_THREADS to an actor's CPUs (1 by default); the engine child inherits
    this environment and torch reads OMP_NUM_THREADS when it starts.
    """
    import torch

    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)

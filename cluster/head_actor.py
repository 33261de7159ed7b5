"""kvray's detached actors on the head node (the LoRA registry, the KV directory): one per
application, found by name from any replica or ingress, created by whoever asks first."""

from __future__ import annotations

from typing import Any

from cluster.ray_internals import HEAD_NODE_RESOURCE, KVRAY_NAMESPACE


def head_actor(cls: type, name: str, *args: Any) -> Any:
    """The actor `name` of class `cls`, created with `args` if it does not exist yet."""
    import ray

    return (
        ray.remote(cls)
        .options(
            name=name,
            namespace=KVRAY_NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            resources={HEAD_NODE_RESOURCE: 0.001},
            # Not in the calling replica's placement group, which would capture it.
            scheduling_strategy="DEFAULT",
            max_restarts=-1,  # restarted empty (each class's doc says what that costs)
        )
        .remote(*args)
    )


def kill_head_actor(name: str) -> bool:
    """Kills the actor `name` for good; whether there was one."""
    import ray

    try:
        actor = ray.get_actor(name, namespace=KVRAY_NAMESPACE)
    except ValueError:  # no such actor
        return False
    ray.kill(actor, no_restart=True)
    return True

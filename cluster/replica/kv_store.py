"""The owner of a node's blocks in the cluster KV tier: one actor per application and node.

An object in Ray's store lives only as long as its owner, the process that put it (Ray 2.56
removed `ray.put(..., _owner=...)`, which let a process put on another's behalf). A replica
that put its own blocks would take them with it when it dies, which is exactly when a
migrated request wants them. So each replica hands its exported blocks to the store actor of
its own node (`kv-store/<app>/<node id>`, pinned there, created by the first replica on the
node), which puts them and publishes the references to the application's directory
(cluster/replica/kv_directory.py). The data never leaves the node to be published; a block
outlives its replica and dies with its node (or this actor), after which a puller's read
fails and it recomputes.

The store keeps no reference of its own once it has published one: the directory's is the
last, so the directory's eviction frees the object.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cluster.ray_internals import KVRAY_NAMESPACE

if TYPE_CHECKING:
    from workers.messages.kv_blocks import KvBlockData

NAME_PREFIX = "kv-store/"


class KvNodeStore:
    def __init__(self, directory: Any) -> None:
        self.directory = directory
        self.stored = 0  # blocks put and published (cumulative)

    def put(self, layout: str, blocks: list[KvBlockData]) -> int:
        """Puts each block into the object store (owned here) and publishes it; returns how
        many. A block that does not fit (the store full) is skipped: peers recompute it."""
        import ray

        entries = []
        for b in blocks:
            try:
                ref = ray.put((layout, b))
            except Exception:  # noqa: BLE001 - ObjectStoreFullError and the like
                continue
            entries.append((b.block_hash, [ref], b.num_bytes))
        if entries:
            self.directory.publish.remote(layout, entries)
        self.stored += len(entries)
        return len(entries)


def store_name(app_name: str, node_id: str) -> str:
    return f"{NAME_PREFIX}{app_name}/{node_id}"


def node_store(app_name: str, directory: Any) -> Any:
    """The store actor of the calling process's node, created if it does not exist yet."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_id = ray.get_runtime_context().get_node_id()
    return (
        ray.remote(KvNodeStore)
        .options(
            name=store_name(app_name, node_id),
            namespace=KVRAY_NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        )
        .remote(directory)
    )


def delete_stores(app_name: str) -> int:
    """Kills the application's store actors (their objects are freed); how many there were."""
    import ray

    prefix = f"{NAME_PREFIX}{app_name}/"
    killed = 0
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["namespace"] == KVRAY_NAMESPACE and a["name"].startswith(prefix):
            try:
                ray.kill(ray.get_actor(a["name"], namespace=KVRAY_NAMESPACE), no_restart=True)
                killed += 1
            except ValueError:  # gone meanwhile
                pass
    return killed

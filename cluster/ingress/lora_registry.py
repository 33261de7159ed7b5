"""The adapters loaded at run time, shared by every ingress replica of one application.

    registry = registry_actor(app_name)        # created by the first ingress, then found
    await registry.snapshot.remote(statics, known_version)  # None when nothing changed
    await registry.load.remote(statics, name, path)

Why a detached, named Ray actor per application (`lora-registry/<app>` in the `kvray`
namespace), created with `get_if_exists`:

- Every ingress replica, HTTP and gRPC, of any node, finds the same one by name: a load
  through one is seen by all. Ray's GCS serialises its creation, so replicas starting
  together get one actor, and the actor runs one method at a time, so ids never race.
- Detached, it does not die with the ingress replica that created it: an ingress restarted
  by Serve (a crash, a node lost, an autoscaled replica) finds the adapters where they were.
  An ingress-local state could not be shared; a Serve deployment would be replaced with
  the application's code version on every redeploy, losing the state each time; Ray's
  internal KV store is a private API and has no atomic id counter.
- It is pinned to the head node, like the gRPC ingress: losing the head loses the cluster
  anyway. Should the actor itself be restarted (Ray restarts it; with GCS fault tolerance,
  after a head restart), the runtime adapters are forgotten (load them again), and the ids
  it gives start above the clock's microseconds, beyond any id given before.

What it holds: the runtime adapters, the names of static adapters (cluster/config/lora.py,
known to every ingress from the config) unloaded since, and the next id. An id is never
given twice: adapters are told apart by it on the engines (device slots, prefix cache), so a
name unloaded and loaded again, maybe from a changed file, gets a new one.

A static adapter's id is not the registry's: every ingress derives it from the adapter's name
and path (`static_id`), in [2**62, 2**63), above every runtime id. So a redeploy (or restart)
that serves a name from another directory gives it another id, and no engine serves it with
the weights it holds under the old one; the same name and path keep their id, and with it
the engines' slots and prefix cache. Runtime ids stay below 2**62 and above N, the static
adapters' count (`Statics`: the ids 1..N earlier versions gave them by position, which an
ingress of such a version may still use during a rolling update): should a redeploy add
static adapters, runtime adapters whose ids N reaches move to new ids (the engines then load
them again, under the new id).

It outlives the application: `kvray serve` removes it when it stops (`delete_registry`); an
application deleted otherwise (`serve delete`) and deployed again under the same name finds
its runtime adapters again.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

from cluster.head_actor import head_actor, kill_head_actor

NAME_PREFIX = "lora-registry/"
# Static adapters' ids are in [STATIC_ID_BASE, 2 * STATIC_ID_BASE); runtime ids are below it
# (a counter from N + 1, or from the clock's microseconds, about 2**51, after a restart).
STATIC_ID_BASE = 2**62


@dataclass(frozen=True)
class Adapter:
    """A servable adapter: what `model: name` resolves to."""

    name: str
    lora_int_id: int
    path: str


def static_id(name: str, path: str) -> int:
    """The id of the static adapter `name` served from `path`: the same on every ingress and
    across restarts while both stay, another one when either changes (module doc)."""
    digest = hashlib.sha256(f"{name}\0{path}".encode()).digest()
    return STATIC_ID_BASE + int.from_bytes(digest[:8], "big") % STATIC_ID_BASE


@dataclass(frozen=True)
class Statics:
    """The caller's static adapters: their names, in the config's order (runtime ids stay
    above their count, module doc)."""

    names: tuple[str, ...] = ()

    @property
    def first_runtime_id(self) -> int:
        return len(self.names) + 1


@dataclass(frozen=True)
class Snapshot:
    """The registry's state at one version (what an ingress caches)."""

    version: tuple[int, int]  # (the actor's start time, its change count): compared for equality
    runtime: tuple[Adapter, ...]  # in load order
    unloaded_static: frozenset[str]  # static adapters' names unloaded since


class LoraRegistry:
    """The actor (module doc). Its methods return results, never raise for a refusal: the
    ingress turns them into its own errors."""

    def __init__(self, restarted: bool | None = None) -> None:
        # `restarted`: whether Ray restarted this actor (None: ask Ray; tests say).
        if restarted is None:
            import ray

            restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self._start = time.time_ns()
        self._changes = 0
        self._runtime: dict[str, Adapter] = {}
        self._unloaded: set[str] = set()
        self._next_id = 1
        if restarted:
            # The ids given before the restart are lost with the state: start above them all.
            self._next_id = self._start // 1000

    def snapshot(self, statics: Statics, known: tuple[int, int] | None = None) -> Snapshot | None:
        """The state, or None when it is still at version `known`."""
        self._above_statics(statics)
        version = (self._start, self._changes)
        if known == version:
            return None
        return Snapshot(version, tuple(self._runtime.values()), frozenset(self._unloaded))

    def load(self, statics: Statics, name: str, path: str) -> tuple[Adapter | None, Snapshot]:
        """Registers `name` under a new id, or returns None when the name is taken (by a
        runtime adapter, or a static one not unloaded)."""
        self._above_statics(statics)
        if name in self._runtime or (name in statics.names and name not in self._unloaded):
            return None, self._snapshot(statics)
        adapter = Adapter(name, self._new_id(), path)
        self._runtime[name] = adapter
        self._changes += 1
        return adapter, self._snapshot(statics)

    def unload(self, statics: Statics, name: str) -> tuple[bool, Snapshot]:
        """Forgets `name` (a runtime adapter, else a static one not yet unloaded); whether
        there was one."""
        self._above_statics(statics)
        if name in self._runtime:
            del self._runtime[name]
        elif name in statics.names and name not in self._unloaded:
            self._unloaded.add(name)
        else:
            return False, self._snapshot(statics)
        self._changes += 1
        return True, self._snapshot(statics)

    def _above_statics(self, statics: Statics) -> None:
        """Runtime ids start above the static adapters' (module doc)."""
        self._next_id = max(self._next_id, statics.first_runtime_id)
        low = [a for a in self._runtime.values() if a.lora_int_id < statics.first_runtime_id]
        for a in low:
            self._runtime[a.name] = Adapter(a.name, self._new_id(), a.path)
        if low:
            self._changes += 1

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _snapshot(self, statics: Statics) -> Snapshot:
        snap = self.snapshot(statics)
        assert snap is not None
        return snap


def registry_name(app_name: str) -> str:
    return NAME_PREFIX + app_name


def registry_actor(app_name: str) -> Any:
    """The application's registry actor, created if it does not exist yet."""
    return head_actor(LoraRegistry, registry_name(app_name))


def delete_registry(app_name: str) -> bool:
    """Kills the application's registry actor; whether there was one."""
    return kill_head_actor(registry_name(app_name))

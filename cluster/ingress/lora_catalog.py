"""What a request's `model` names, at both ingresses: the served model or a LoRA adapter.

    catalog = LoraCatalog.from_config(config)
    target = await catalog.target(body.model)     # ModelNotFoundError for an unknown name
    prepared = await preparer.prepare(body, lora=target.lora, tenant=...)  # under the adapter
    fmt = Formatter(..., target.name, ...)        # answers echo the name the client sent

The served model's name (or no model) runs on the base model. An adapter's name runs its
`EngineInput`s with `lora = LoRARequest(name, id, path, base_model_name=served)`, set when
they are checked (cluster/ingress/prepare.py): the engine reads the adapter when it first
sees the id (and refuses one it cannot serve).

Adapters: the config's (`lora_modules`, each id derived from its name and path, so a changed
path is a new id: lora_registry.static_id), and with `enable_runtime_lora` the ones loaded
at run time, held by the application's registry actor (cluster/ingress/lora_registry.py).
Each ingress caches the registry's state: a name it does not know, and a listing, ask the
registry again, so an adapter loaded through another ingress is found and listed at once
(such calls arriving together share one registry call: one in flight per ingress); a known
name is trusted for REFRESH_S, so an adapter unloaded through another ingress stops
resolving there within that time (at once on the ingress that unloaded it). Requests naming
the served model never ask. Requests already running under an unloaded adapter finish under
it: they carry its path, and the engine frees its slot when they end.

A load reads the adapter against the served model first, on a worker thread, with the check
the engines run (workers/lora/checkpoint.py), so a corrupt or incompatible adapter is a 400
naming its file and field, and nothing is registered.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from cluster.config import ServeConfig, resolve_model_dir
from cluster.config.lora import LoraModule
from cluster.errors import InvalidRequestError, ModelNotFoundError
from cluster.ingress.lora_errors import (
    LoraAdapterExistsError,
    LoraAdapterNotFoundError,
    LoraRegistryUnavailableError,
    RuntimeLoraOffError,
)
from cluster.ingress.lora_registry import Adapter, Snapshot, Statics, static_id
from workers.lora.request import LoRARequest

logger = logging.getLogger("ray.serve.kvray.lora")

REFRESH_S = 1.0  # how stale a cached adapter may be (an unload elsewhere shows within this)
MAX_NAME_CHARS = 256


@dataclass(frozen=True)
class ModelTarget:
    """What a request runs on: `lora` None is the base model; `name` is what answers echo."""

    name: str
    lora: LoRARequest | None = None


class AdapterCheck:
    """Reads an adapter directory against the served model as the engines will; raises
    workers.lora.checkpoint.LoraError (a ValueError naming the file and field)."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config

    @cached_property
    def model_config(self) -> Any:
        from workers.config import ModelConfig

        return ModelConfig.from_pretrained(resolve_model_dir(self.config))

    def __call__(self, path: str) -> None:
        from workers.lora.checkpoint import load_adapter

        load_adapter(path, self.model_config, self.config.lora.max_lora_rank)

    def check_static(self) -> None:
        """Every adapter of the config (an ingress starting): ValueError naming the first bad
        one, so the deployment fails to start instead of its requests."""
        for i, m in enumerate(self.config.lora.lora_modules or ()):
            try:
                self(m.path)
            except ValueError as err:
                raise ValueError(f"lora_modules[{i}] ({m.name}): {err}") from None


class LoraCatalog:
    """One ingress replica's view of the served model and its adapters (module doc).

    `registry`: a function giving the registry actor (runtime loading on), or None (off: the
    config's adapters only). `check`: the adapter check a load runs (AdapterCheck)."""

    def __init__(
        self,
        served: str,
        static: tuple[LoraModule, ...] = (),
        registry: Callable[[], Any] | None = None,
        check: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.served = served
        self._static = {m.name: Adapter(m.name, static_id(m.name, m.path), m.path) for m in static}
        self._statics = Statics(tuple(self._static))
        self._registry_fn = registry
        self._registry: Any = None
        self._check = check
        self._clock = clock
        self._snapshot: Snapshot | None = None
        self._fetched_at = -float("inf")
        self._lock = asyncio.Lock()  # one registry call at a time; the others reuse its answer
        self._view: dict[str, Adapter] = dict(self._static)

    @staticmethod
    def from_config(
        config: ServeConfig, app_name: str | None = None, check: AdapterCheck | None = None
    ) -> LoraCatalog:
        """The catalog of an ingress of application `app_name` (the registry's key; None:
        this Serve replica's application)."""
        registry = None
        if config.lora.enable_runtime_lora:

            def registry() -> Any:
                from cluster.ingress.lora_registry import registry_actor

                name = app_name
                if name is None:
                    from ray import serve

                    name = serve.get_replica_context().app_name
                return registry_actor(name)

        static = config.lora.lora_modules or ()
        return LoraCatalog(
            config.engine.model_name(), static, registry, check or AdapterCheck(config)
        )

    @property
    def runtime_loading(self) -> bool:
        return self._registry_fn is not None

    async def target(self, model: str | None) -> ModelTarget:
        """The served model for None, "" or its name; else the adapter of that name, or
        ModelNotFoundError (404 / NOT_FOUND, as any unknown model)."""
        if not model or model == self.served:
            return ModelTarget(self.served)
        adapter = await self.find(model)
        if adapter is None:
            raise ModelNotFoundError(model)
        lora = LoRARequest(adapter.name, adapter.lora_int_id, adapter.path, self.served)
        return ModelTarget(model, lora)

    async def find(self, name: str) -> Adapter | None:
        if self.runtime_loading:
            await self._refresh(REFRESH_S)
            if name not in self._view:
                await self._refresh(None)
        return self._view.get(name)

    async def adapters(self) -> list[Adapter]:
        """The adapters served now: the config's (in order), then the runtime ones. A listing
        asks the registry (as a miss does): rare, and it must show what was just loaded."""
        if self.runtime_loading:
            await self._refresh(None)
        return list(self._view.values())

    async def load(self, name: Any, path: Any) -> Adapter:
        """Registers an adapter for every ingress (module doc); errors name the field."""
        registry = self._runtime_registry()
        name, path = self._checked_load_fields(name, path)
        if await self.find(name) is not None:
            raise LoraAdapterExistsError(name)
        try:
            await asyncio.to_thread(self._check or (lambda _: None), path)
        except ValueError as err:  # LoraError: the message names the file and field
            raise InvalidRequestError("lora_path", str(err)) from None
        adapter, snapshot = await self._call(registry.load, name, path)
        if adapter is None:
            raise LoraAdapterExistsError(name)
        logger.info("LoRA adapter %r loaded from %s (id %d)", name, path, adapter.lora_int_id)
        return adapter

    async def unload(self, name: Any) -> None:
        """Stops serving `name` to new requests (module doc); LoraAdapterNotFoundError when
        it is not loaded."""
        registry = self._runtime_registry()
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("lora_name", "lora_name must be a non-empty string")
        found, snapshot = await self._call(registry.unload, name)
        if not found:
            raise LoraAdapterNotFoundError(name)
        logger.info("LoRA adapter %r unloaded", name)

    # -- helpers ---------------------------------------------------------------------------

    def _checked_load_fields(self, name: Any, path: Any) -> tuple[str, str]:
        if not isinstance(name, str) or not name.strip():
            raise InvalidRequestError("lora_name", "lora_name must be a non-empty string")
        if len(name) > MAX_NAME_CHARS:
            raise InvalidRequestError(
                "lora_name", f"lora_name must be at most {MAX_NAME_CHARS} characters"
            )
        if name == self.served:
            raise InvalidRequestError("lora_name", f"lora_name {name!r} is the served model's name")
        if not isinstance(path, str) or not os.path.isabs(path):
            raise InvalidRequestError(
                "lora_path", f"lora_path must be an absolute directory path, got {path!r}"
            )
        return name, path

    def _runtime_registry(self) -> Any:
        if self._registry_fn is None:
            raise RuntimeLoraOffError()
        if self._registry is None:
            self._registry = self._registry_fn()
        return self._registry

    async def _call(self, method: Any, *args: Any) -> tuple[Any, Snapshot]:
        """A load or unload: (its result, the registry's state after it, now cached)."""
        asked = self._clock()
        try:
            result, snapshot = await method.remote(self._statics, *args)
        except Exception as err:  # the actor died or is restarting (Ray restarts it)
            self._registry = None  # look it up again next time
            raise LoraRegistryUnavailableError(f"{type(err).__name__}: {err}") from None
        self._take(snapshot, asked)
        return result, snapshot

    async def _refresh(self, stale_after_s: float | None) -> None:
        """Asks the registry for news when the cache is older than `stale_after_s`, or (None)
        unless a call that started since this one arrived already did. On an error keeps
        the cache (logged) and asks again next time."""
        arrived = self._clock()
        if stale_after_s is not None and arrived - self._fetched_at < stale_after_s:
            return
        async with self._lock:
            if self._fetched_at >= arrived or (
                stale_after_s is not None and self._clock() - self._fetched_at < stale_after_s
            ):
                return  # another call asked while this one waited
            started = self._clock()
            known = self._snapshot.version if self._snapshot is not None else None
            try:
                registry = self._runtime_registry()
                snapshot = await registry.snapshot.remote(self._statics, known)
            except Exception as err:
                self._registry = None
                self._fetched_at = started  # the cache stands for a while; then ask again
                logger.warning("LoRA registry unavailable, serving the cached adapters: %s", err)
                return
            self._fetched_at = started
            if snapshot is not None:
                self._take(snapshot, started)

    def _take(self, snapshot: Snapshot, asked_at: float) -> None:
        """The view from a registry snapshot: the static adapters not unloaded, then the
        runtime ones (a runtime name shadows a static one of the same name). An answer older
        than the cached one (calls that crossed) is dropped."""
        old = self._snapshot
        if old is not None and old.version[0] == snapshot.version[0]:
            if old.version[1] > snapshot.version[1]:
                return
        self._snapshot = snapshot
        runtime = {a.name: a for a in snapshot.runtime}
        view = {
            name: a
            for name, a in self._static.items()
            if name not in snapshot.unloaded_static and name not in runtime
        }
        self._view = view | runtime
        self._fetched_at = max(self._fetched_at, asked_at)

"""What `model` resolves to at an ingress (cluster/ingress/lora_catalog.py): the base model,
an adapter (its LoRARequest, which the preparation puts on every engine input), or 404;
loads checked before they are registered; two ingresses sharing one registry (the real
class, called in process instead of through Ray), their caches' refresh on a fake clock."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from cluster.config import ServeConfig
from cluster.errors import InvalidRequestError, ModelNotFoundError
from cluster.ingress.lora_catalog import REFRESH_S, LoraCatalog, ModelTarget
from cluster.ingress.lora_errors import (
    LoraAdapterExistsError,
    LoraAdapterNotFoundError,
    LoraRegistryUnavailableError,
    RuntimeLoraOffError,
)
from cluster.ingress.lora_registry import LoraRegistry, static_id
from workers.lora.checkpoint import LoraError
from workers.lora.request import LoRARequest

SERVED = "kvray-demo"
STATIC = ServeConfig.from_flat(lora_modules=["a=/x/a", "b=/x/b"]).lora.lora_modules


class InProcess:
    """An actor handle's shape (`handle.method.remote(...)` awaitable) over a local object;
    `down` makes every call fail as a dead actor's would."""

    def __init__(self, target: Any) -> None:
        self.target = target
        self.down = False
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.target, name)
        outer = self

        class Method:
            @staticmethod
            async def remote(*args: Any) -> Any:
                outer.calls += 1
                if outer.down:
                    raise RuntimeError("actor died")
                return method(*args)

        return Method()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _catalog(
    registry: InProcess | None, clock: Clock, check: Callable[[str], None] | None = None
) -> LoraCatalog:
    factory = (lambda: registry) if registry is not None else None
    return LoraCatalog(SERVED, STATIC, factory, check or (lambda _: None), clock=clock)


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_the_model_an_adapter_or_not_found() -> None:
    catalog = _catalog(None, Clock())
    for model in (None, "", SERVED):
        assert _run(catalog.target(model)) == ModelTarget(SERVED)
    target = _run(catalog.target("b"))
    assert target == ModelTarget("b", LoRARequest("b", static_id("b", "/x/b"), "/x/b", SERVED))
    with pytest.raises(ModelNotFoundError, match="'c'"):
        _run(catalog.target("c"))
    want = [("a", static_id("a", "/x/a")), ("b", static_id("b", "/x/b"))]
    assert [(a.name, a.lora_int_id) for a in _run(catalog.adapters())] == want


def test_a_static_adapter_keeps_its_id_only_while_its_path_stays() -> None:
    """A redeploy (or restart) serving a name from another directory: another id, so no
    engine serves it with the weights it holds under the old one (they are keyed by id)."""
    before = _catalog(None, Clock())

    def catalog(*modules: str) -> LoraCatalog:
        return LoraCatalog(SERVED, ServeConfig.from_flat(lora_modules=modules).lora.lora_modules)

    same, moved = catalog("a=/x/a", "b=/x/b"), catalog("a=/y/a", "b=/x/b")
    reordered = catalog("b=/x/b", "a=/x/a")

    def lora(catalog: LoraCatalog, name: str) -> LoRARequest:
        found = _run(catalog.target(name)).lora
        assert found is not None
        return found

    assert lora(same, "a") == lora(before, "a") == lora(reordered, "a")
    assert lora(moved, "a").lora_int_id != lora(before, "a").lora_int_id
    assert lora(moved, "a").lora_path == "/y/a"
    assert lora(moved, "b") == lora(before, "b")


def test_without_runtime_loading_load_and_unload_are_refused() -> None:
    catalog = _catalog(None, Clock())
    assert not catalog.runtime_loading
    with pytest.raises(RuntimeLoraOffError) as err:
        _run(catalog.load("c", "/x/c"))
    assert err.value.grpc_code == "UNIMPLEMENTED" and "--enable-runtime-lora" in err.value.message
    with pytest.raises(RuntimeLoraOffError):
        _run(catalog.unload("a"))


def test_a_load_is_checked_before_it_is_registered() -> None:
    def check(path: str) -> None:
        if path.endswith("bad"):
            raise LoraError(f"{path}/adapter_config.json: use_dora (True) is not supported")

    registry = InProcess(LoraRegistry(restarted=False))
    catalog = _catalog(registry, Clock(), check)
    cases = [
        (("", "/x/c"), "lora_name"),
        ((None, "/x/c"), "lora_name"),
        ((SERVED, "/x/c"), "lora_name"),
        (("c", "relative/c"), "lora_path"),
        (("c", "/x/bad"), "lora_path"),
    ]
    for args, field in cases:
        with pytest.raises(InvalidRequestError) as err:
            _run(catalog.load(*args))
        assert err.value.field == field, err.value.message
    assert "use_dora" in err.value.message  # the adapter check's own words
    assert registry.target.snapshot(catalog._statics).runtime == ()  # nothing registered
    with pytest.raises(LoraAdapterExistsError) as exists:
        _run(catalog.load("a", "/x/c"))
    assert (exists.value.http_status, exists.value.grpc_code) == (400, "ALREADY_EXISTS")
    c = _run(catalog.load("c", "/x/c"))
    assert (c.name, c.lora_int_id, c.path) == ("c", 3, "/x/c")
    assert _run(catalog.target("c")).lora == LoRARequest("c", 3, "/x/c", SERVED)


def test_two_ingresses_share_the_registry() -> None:
    registry = InProcess(LoraRegistry(restarted=False))
    clock = Clock()
    one, two = _catalog(registry, clock), _catalog(registry, clock)
    assert _run(two.target("a")).lora is not None  # two's cache is now fresh
    _run(one.load("c", "/x/c"))
    # An unknown name asks the registry again: found at once.
    clock.now += 0.001
    assert _run(two.target("c")).lora.lora_int_id == 3
    # An unload shows at once where it happened, elsewhere within REFRESH_S.
    _run(one.unload("c"))
    _run(one.unload("a"))  # a static adapter, too
    for name in ("c", "a"):
        with pytest.raises(ModelNotFoundError):
            _run(one.target(name))
    assert _run(two.target("a")).lora is not None  # two's cache: still fresh
    clock.now += REFRESH_S
    with pytest.raises(ModelNotFoundError):
        _run(two.target("a"))
    assert [a.name for a in _run(two.adapters())] == ["b"]
    with pytest.raises(LoraAdapterNotFoundError) as err:
        _run(two.unload("c"))
    assert (err.value.http_status, err.value.grpc_code) == (404, "NOT_FOUND")
    # Loaded again: a new id, and a runtime adapter named like a static one.
    again = _run(two.load("a", "/x/a2"))
    assert again.lora_int_id == 4 and [a.name for a in _run(one.adapters())] == ["b", "a"]


def test_unknown_names_arriving_together_share_one_registry_call() -> None:
    registry = InProcess(LoraRegistry(restarted=False))
    clock = Clock()
    catalog = _catalog(registry, clock)

    async def misses() -> list[Any]:
        return await asyncio.gather(
            *(catalog.target(f"nope{i}") for i in range(5)), return_exceptions=True
        )

    assert all(isinstance(e, ModelNotFoundError) for e in _run(misses()))
    assert registry.calls == 1
    clock.now += 0.001  # a miss arriving after that call asks again
    with pytest.raises(ModelNotFoundError):
        _run(catalog.target("nope"))
    assert registry.calls == 2
    assert _run(catalog.target(SERVED)).lora is None and registry.calls == 2  # never asks


def test_a_registry_that_does_not_answer() -> None:
    registry = InProcess(LoraRegistry(restarted=False))
    clock = Clock()
    catalog = _catalog(registry, clock)
    _run(catalog.load("c", "/x/c"))
    registry.down = True
    clock.now += REFRESH_S
    # Resolution keeps the cached adapters; loads and unloads say to retry (503).
    assert _run(catalog.target("c")).lora is not None
    for call in (catalog.load("d", "/x/d"), catalog.unload("c")):
        with pytest.raises(LoraRegistryUnavailableError) as err:
            _run(call)
        assert (err.value.http_status, err.value.grpc_code) == (503, "UNAVAILABLE")
    registry.down = False
    assert _run(catalog.load("d", "/x/d")).lora_int_id == 4

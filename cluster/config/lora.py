"""The LoRA section: the adapters served with the model, the engine's LoRA limits, how
`lora_modules` is read, and the EngineArgs they become (docs/lora.md).

`lora_modules` takes what vLLM's `--lora-modules` takes: `name=path`, or a JSON object
`{"name", "path", "base_model_name"}`; in a YAML `args:` mapping also such an object as a
mapping. It is stored as a tuple of `LoraModule`, and written back to YAML as mappings.

Adapter directories are checked where they are read: `kvray serve` on a local Ray checks that
they exist before it starts (`lora_modules_missing`), and the HTTP ingress reads each one
against the served model when it starts (cluster/ingress/lora_catalog.py), so a bad adapter
fails the deployment with its file and field named instead of failing requests later.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cluster.config.checks import is_int, need_bools, need_positive_ints
from cluster.config.setting import LORA_GROUP, declared, setting
from workers.lora.config import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS

# The one spelling of an adapter on the command line (`--lora-modules NAME=PATH`).
MODULE_SEPARATOR = "="


@dataclass(frozen=True)
class LoraModule:
    """An adapter served from start-up: requests select it with `model: name`."""

    name: str
    path: str  # the PEFT adapter directory, as the replicas' nodes see it
    base_model_name: str | None = None  # informational (vLLM's field); must be the served model

    def to_arg(self) -> dict[str, str]:
        """The YAML form (a mapping; None fields left out)."""
        out = {"name": self.name, "path": self.path}
        if self.base_model_name is not None:
            out["base_model_name"] = self.base_model_name
        return out


def parse_lora_module(value: Any, where: str = "lora_modules") -> LoraModule:
    """One adapter from `name=path`, a JSON object, or a mapping; ValueError naming `where`."""
    if isinstance(value, LoraModule):
        return value
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where} must be NAME=PATH or a JSON object: {err}") from None
    if isinstance(value, str):
        name, sep, path = value.partition(MODULE_SEPARATOR)
        if not sep:
            raise ValueError(f"{where} must be NAME=PATH or a JSON object, got {value!r}")
        value = {"name": name, "path": path}
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be NAME=PATH or a mapping, got {value!r}")
    unknown = sorted(set(value) - {"name", "path", "base_model_name"})
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}: name, path, base_model_name")
    for key in ("name", "path"):
        v = value.get(key)
        if not isinstance(v, str) or not v.strip():
            raise ValueError(f"{where}.{key} must be a non-empty string, got {v!r}")
    base = value.get("base_model_name")
    if base is not None and not isinstance(base, str):
        raise ValueError(f"{where}.base_model_name must be a string, got {base!r}")
    return LoraModule(value["name"], value["path"], base)


def parse_lora_modules(value: Any) -> tuple[LoraModule, ...] | None:
    """ServeConfig.lora_modules as given (flags, YAML, Python) -> a tuple, None when empty."""
    if value is None:
        return None
    if isinstance(value, (str, Mapping, LoraModule)):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"lora_modules must be a list of NAME=PATH, got {value!r}")
    modules = tuple(parse_lora_module(v, f"lora_modules[{i}]") for i, v in enumerate(value))
    return modules or None


def absolute_modules(modules: tuple[LoraModule, ...] | None) -> tuple[LoraModule, ...] | None:
    """The flags' paths made absolute (they name this machine's current directory)."""
    if modules is None:
        return None
    return tuple(LoraModule(m.name, os.path.abspath(m.path), m.base_model_name) for m in modules)


@dataclass(frozen=True)
class LoraSettings:
    """LoRA adapters served with the model."""

    enable_lora: bool = setting(
        False,
        "serve LoRA adapters of the model; implied by --lora-modules and --enable-runtime-lora",
        LORA_GROUP,
    )
    # Given as flags, YAML or Python; stored as a tuple of LoraModule (None when empty).
    lora_modules: tuple[LoraModule, ...] | None = setting(
        None,
        "adapters served from start-up, each NAME=PATH (a PEFT adapter directory) or a JSON "
        'object {"name": ..., "path": ..., "base_model_name": ...}; a request selects one '
        "with model: NAME (default: none)",
        LORA_GROUP,
        kind="lora_modules",
    )
    max_loras: int = setting(
        DEFAULT_MAX_LORAS,
        "adapters each engine holds on its device at once (one step serves at most this many)",
        LORA_GROUP,
        engine=True,
    )
    max_lora_rank: int = setting(
        DEFAULT_MAX_LORA_RANK,
        "largest adapter rank served; larger: refused when loaded",
        LORA_GROUP,
        engine=True,
    )
    max_cpu_loras: int | None = setting(
        None,
        "adapters each engine keeps read in host memory, least recently used dropped; at "
        "least --max-loras (default: the engine's, max(32, --max-loras))",
        LORA_GROUP,
        engine=True,
    )
    enable_runtime_lora: bool = setting(
        False,
        "POST /v1/load_lora_adapter and /v1/unload_lora_adapter (gRPC LoadLoraAdapter, "
        "UnloadLoraAdapter) for any API key holder; without it they answer 404 / UNIMPLEMENTED",
        LORA_GROUP,
    )

    def __post_init__(self) -> None:
        # YAML lists and flag strings become LoraModules (frozen: set through object).
        object.__setattr__(self, "lora_modules", parse_lora_modules(self.lora_modules))
        need_bools(self, "enable_lora", "enable_runtime_lora")
        need_positive_ints(self, "max_loras", "max_lora_rank")
        cpu = self.max_cpu_loras
        if cpu is not None and (not is_int(cpu) or cpu < self.max_loras):
            raise ValueError(
                f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}) or null, "
                f"got {cpu!r}"
            )
        seen: set[str] = set()
        for i, m in enumerate(self.lora_modules or ()):
            if m.name in seen:
                raise ValueError(f"lora_modules[{i}].name ({m.name!r}) is given twice")
            seen.add(m.name)

    def check_served(self, served: str) -> None:
        """ValueError unless the adapters can be told apart from the served model `served`."""
        for i, m in enumerate(self.lora_modules or ()):
            if m.name == served:
                raise ValueError(
                    f"lora_modules[{i}].name ({m.name!r}) is the served model's name: requests "
                    "could not tell them apart"
                )
            if m.base_model_name is not None and m.base_model_name != served:
                raise ValueError(
                    f"lora_modules[{i}].base_model_name ({m.base_model_name!r}) is not the "
                    f"served model ({served!r})"
                )

    @property
    def enabled(self) -> bool:
        """Whether the engines serve adapters: asked for, or implied by adapters to serve."""
        return bool(self.enable_lora or self.lora_modules or self.enable_runtime_lora)

    def engine_args(self) -> dict[str, Any]:
        """The EngineArgs keyword arguments of this section (workers/config.py)."""
        return {
            "enable_lora": self.enabled,
            **{f.name: getattr(self, f.name) for f, s in declared(LoraSettings) if s.engine},
        }

    def modules_missing(self) -> str | None:
        """What is wrong with adapter directories that must be on this machine (kvray serve
        on a local Ray): None when every one is a directory (their content is read by the
        ingress)."""
        for i, m in enumerate(self.lora_modules or ()):
            if not os.path.isdir(m.path):
                return f"lora_modules[{i}] ({m.name}): {m.path}: no such directory"
        return None

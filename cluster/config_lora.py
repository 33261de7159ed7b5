"""ServeConfig's LoRA fields (and expert parallelism, the other engine switch): their flags'
help, how `lora_modules` is read, their checks, and the EngineArgs they become
(docs/lora.md). cluster/config.py declares the fields with `lora_field(name)`, so each
field's default and help are written here once.

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
from dataclasses import dataclass, field
from typing import Any

from cluster.config_flag import LORA_GROUP, MODEL_GROUP, Flag
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


_HELP: dict[str, tuple[Any, str, str, str]] = {
    # name: (default, help, group, flag kind)
    "enable_lora": (
        False,
        "serve LoRA adapters of the model; implied by --lora-modules and --enable-runtime-lora",
        LORA_GROUP,
        "",
    ),
    "lora_modules": (
        None,
        "adapters served from start-up, each NAME=PATH (a PEFT adapter directory) or a JSON "
        'object {"name": ..., "path": ..., "base_model_name": ...}; a request selects one '
        "with model: NAME (default: none)",
        LORA_GROUP,
        "lora_modules",
    ),
    "max_loras": (
        DEFAULT_MAX_LORAS,
        "adapters each engine holds on its device at once (one step serves at most this many)",
        LORA_GROUP,
        "",
    ),
    "max_lora_rank": (
        DEFAULT_MAX_LORA_RANK,
        "largest adapter rank served; larger: refused when loaded",
        LORA_GROUP,
        "",
    ),
    "max_cpu_loras": (
        None,
        "adapters each engine keeps read in host memory, least recently used dropped; at "
        "least --max-loras (default: the engine's, max(32, --max-loras))",
        LORA_GROUP,
        "",
    ),
    "enable_runtime_lora": (
        False,
        "POST /v1/load_lora_adapter and /v1/unload_lora_adapter (gRPC LoadLoraAdapter, "
        "UnloadLoraAdapter) for any API key holder; without it they answer 404 / UNIMPLEMENTED",
        LORA_GROUP,
        "",
    ),
    "enable_expert_parallel": (
        False,
        "mixture-of-experts models: give each tensor-parallel rank whole experts instead of a "
        "slice of every expert",
        MODEL_GROUP,
        "",
    ),
}


def lora_field(name: str) -> Any:
    """The dataclass field of ServeConfig.`name` (one of _HELP's)."""
    default, help, group, kind = _HELP[name]
    return field(default=default, metadata={"flag": Flag(help, group, kind=kind)})


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


def check_lora(cfg: Any) -> None:
    """Raises ValueError naming the first bad LoRA field of a ServeConfig (whose lora_modules
    parse_lora_modules has normalised)."""

    def is_int(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    for name in ("enable_lora", "enable_runtime_lora", "enable_expert_parallel"):
        if not isinstance(getattr(cfg, name), bool):
            raise ValueError(f"{name} must be a boolean, got {getattr(cfg, name)!r}")
    for name in ("max_loras", "max_lora_rank"):
        v = getattr(cfg, name)
        if not is_int(v) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    cpu = cfg.max_cpu_loras
    if cpu is not None and (not is_int(cpu) or cpu < cfg.max_loras):
        raise ValueError(
            f"max_cpu_loras must be an integer >= max_loras ({cfg.max_loras}) or null, got {cpu!r}"
        )
    served = cfg.model_name()
    seen: set[str] = set()
    for i, m in enumerate(cfg.lora_modules or ()):
        if m.name == served:
            raise ValueError(
                f"lora_modules[{i}].name ({m.name!r}) is the served model's name: requests "
                "could not tell them apart"
            )
        if m.name in seen:
            raise ValueError(f"lora_modules[{i}].name ({m.name!r}) is given twice")
        seen.add(m.name)
        if m.base_model_name is not None and m.base_model_name != served:
            raise ValueError(
                f"lora_modules[{i}].base_model_name ({m.base_model_name!r}) is not the served "
                f"model ({served!r})"
            )


def lora_enabled(cfg: Any) -> bool:
    """Whether the engines serve adapters: asked for, or implied by adapters to serve."""
    return bool(cfg.enable_lora or cfg.lora_modules or cfg.enable_runtime_lora)


def lora_engine_kwargs(cfg: Any) -> dict[str, Any]:
    """The EngineArgs keyword arguments of these fields (workers/config.py)."""
    return {
        "enable_lora": lora_enabled(cfg),
        "max_loras": cfg.max_loras,
        "max_lora_rank": cfg.max_lora_rank,
        "max_cpu_loras": cfg.max_cpu_loras,
        "enable_expert_parallel": cfg.enable_expert_parallel,
    }


def lora_modules_missing(cfg: Any) -> str | None:
    """What is wrong with adapter directories that must be on this machine (kvray serve on a
    local Ray): None when every one is a directory (their content is read by the ingress)."""
    for i, m in enumerate(cfg.lora_modules or ()):
        if not os.path.isdir(m.path):
            return f"lora_modules[{i}] ({m.name}): {m.path}: no such directory"
    return None

"""One declaration per setting: a section's dataclass field made with `setting(...)` carries
its default, and its `Setting` metadata the rest (help, --help group, flag spelling, whether
it is an engine argument). Everything else is derived from it: the `kvray serve` / `kvray
config` / `kvray run-batch` flags (cluster/cli/flags.py), the Serve config YAML `args` keys
(the field names: cluster/config/serve.py) and the settings table of docs/contracts.md
(cluster/config/docs_table.py)."""

from __future__ import annotations

from dataclasses import Field, dataclass, field, fields
from typing import Any

# The --help sections the flags are grouped under.
MODEL_GROUP = "model and engine"
REPLICAS_GROUP = "replicas and routing"
NETWORK_GROUP = "network"
LORA_GROUP = "LoRA adapters"
GROUPS = (MODEL_GROUP, LORA_GROUP, REPLICAS_GROUP, NETWORK_GROUP)


@dataclass(frozen=True)
class Setting:
    """How a setting shows on the command line (`kvray serve`, `kvray config`) and reaches
    the engine.

    The flag is `--field-name` unless `name` says otherwise; a boolean field that defaults to
    True gets a `--no-...` flag (give its `name`), one that defaults to False a plain switch.
    Non-None defaults are appended to the help as "(default X)"; the help of a None default
    says what None means.
    """

    help: str
    group: str
    name: str | None = None
    aliases: tuple[str, ...] = ()
    # "size": takes 2GiB / 512MiB / bytes; "path": made absolute; "lora_modules": one or
    # more NAME=PATH (or JSON objects), their paths made absolute (cluster/config/lora.py)
    kind: str = ""
    choices: tuple[str, ...] = ()
    # An EngineArgs keyword of the same name and value (workers/config.py): passed as is.
    engine: bool = False

    def flag(self, key: str) -> str:
        """The flag's spelling for the setting `key`."""
        return self.name or "--" + key.replace("_", "-")


def setting(default: Any, help: str, group: str, **flag: Any) -> Any:
    """A section field: its default and its `Setting` (the other keywords)."""
    return field(default=default, metadata={"setting": Setting(help, group, **flag)})


def declared(section: type[Any]) -> list[tuple[Field[Any], Setting]]:
    """The fields of a section dataclass with their declarations, in declaration order."""
    return [(f, f.metadata["setting"]) for f in fields(section)]

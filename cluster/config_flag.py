"""How a ServeConfig field shows on the command line: its `Flag` metadata and the --help
groups (cluster/config.py re-exports them; cluster/cli/flags.py builds the flags from them)."""

from __future__ import annotations

from dataclasses import dataclass

# The --help sections the flags are grouped under.
MODEL_GROUP = "model and engine"
REPLICAS_GROUP = "replicas and routing"
NETWORK_GROUP = "network"
LORA_GROUP = "LoRA adapters"


@dataclass(frozen=True)
class Flag:
    """How a ServeConfig field shows on the command line (`kvray serve`, `kvray config`).

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
    # more NAME=PATH (or JSON objects), their paths made absolute (cluster/config_lora.py)
    kind: str = ""
    choices: tuple[str, ...] = ()

"""The flags `kvray serve` and `kvray config` share, and their translation into a ServeConfig.

The ServeConfig flags are generated from the settings its sections declare (their default,
type and the `Setting` holding help text, group and spelling: cluster/config/setting.py), so
each default and help text is written once. Only the flags that are not part of the Serve
application (where to listen, the API key itself) are written here.

Imported by `kvray --help`: nothing heavy (no ray, torch, transformers) at module level.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from dataclasses import MISSING, Field
from typing import Any

from cluster.config.lora import absolute_modules, parse_lora_modules
from cluster.config.network import DEFAULT_HTTP_PORT, DEFAULT_METRICS_PORT
from cluster.config.serve import SECTIONS, ServeConfig
from cluster.config.setting import GROUPS, NETWORK_GROUP, Setting
from cluster.config.units import parse_size
from cluster.grpc_api.ingress import DEFAULT_GRPC_PORT


def size_arg(text: str) -> int:
    """argparse `type` for memory sizes (2GiB, 512MiB, bytes)."""
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_serve_flags(parser: argparse.ArgumentParser, default_host: str) -> None:
    groups = {name: parser.add_argument_group(name) for name in GROUPS}
    n = groups[NETWORK_GROUP]
    n.add_argument(
        "--host", default=default_host, help="HTTP/gRPC bind address (default %(default)s)"
    )
    n.add_argument(
        "--port", type=int, default=DEFAULT_HTTP_PORT, help="HTTP port (default %(default)s)"
    )
    n.add_argument(
        "--grpc-port", type=int, default=DEFAULT_GRPC_PORT, help="gRPC port (default %(default)s)"
    )
    n.add_argument(
        "--metrics-port",
        type=int,
        default=DEFAULT_METRICS_PORT,
        help="Ray's metrics export port, scraped at /metrics (default %(default)s)",
    )
    n.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' "
        f"(default: ${ServeConfig().network.api_key_env}, if set)",
    )
    add_config_flags(parser, groups)


def add_config_flags(
    parser: argparse.ArgumentParser, groups: dict[str, argparse._ArgumentGroup] | None = None
) -> None:
    """The ServeConfig settings' flags alone, each in its group (section by section, field
    order within a section): for a command that starts the app but listens nowhere itself
    (`kvray run-batch`)."""
    if groups is None:
        groups = {name: parser.add_argument_group(name) for name in GROUPS}
    hints = {key: h for cls in SECTIONS.values() for key, h in typing.get_type_hints(cls).items()}
    for _, f, flag in ServeConfig.settings():
        _add_field_flag(groups[flag.group], f, flag, hints[f.name])


def _add_field_flag(
    group: argparse._ArgumentGroup, f: Field[Any], flag: Setting, hint: Any
) -> None:
    assert f.default is not MISSING, f"setting {f.name} needs a default"
    name = flag.flag(f.name)
    names = [name, *flag.aliases]
    if isinstance(f.default, bool):
        # A boolean that defaults to on has a flag that turns it off (--no-prefix-caching);
        # one that defaults to off, a switch that turns it on (--enable-runtime-lora).
        assert f.default is False or name.startswith("--no-"), f.name
        action = "store_false" if f.default else "store_true"
        group.add_argument(*names, dest=f.name, action=action, help=flag.help)
        return
    if _base_type(hint) is bool:  # bool | None: --x / --no-x, None leaves the default
        group.add_argument(
            *names, dest=f.name, default=None, action=argparse.BooleanOptionalAction, help=flag.help
        )
        return
    kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": flag.help}
    if f.default is not None:
        kwargs["help"] += " (default %(default)s)"
    if flag.kind == "size":
        kwargs["type"] = size_arg
    elif flag.kind == "lora_modules":  # one or more NAME=PATH; read by config_from_flags
        kwargs |= {"nargs": "+", "metavar": "NAME=PATH"}
    elif _base_type(hint) is int:
        kwargs["type"] = int
    elif _base_type(hint) is float:
        kwargs["type"] = float
    if flag.choices:
        kwargs["choices"] = flag.choices
    if name != "--" + f.name.replace("_", "-") and "metavar" not in kwargs:
        kwargs["metavar"] = name.removeprefix("--").replace("-", "_").upper()
    group.add_argument(*names, **kwargs)


def _base_type(hint: Any) -> Any:
    """int for `int` and `int | None`."""
    if isinstance(hint, types.UnionType):
        (base,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return base
    return hint


def config_from_flags(args: argparse.Namespace) -> ServeConfig:
    """ServeConfig from parsed flags; raises ValueError naming a bad field."""
    values: dict[str, Any] = {}
    for _, f, flag in ServeConfig.settings():
        value = getattr(args, f.name)
        if flag.kind == "path" and value:
            value = os.path.abspath(value)
        elif flag.kind == "lora_modules":
            value = absolute_modules(parse_lora_modules(value))
        values[f.name] = value
    return ServeConfig.from_flat(**values)


def api_key_from(args: argparse.Namespace) -> str | None:
    """--api-key, else the env var named by --api-key-env (read now, at the edge)."""
    return args.api_key or os.environ.get(args.api_key_env) or None

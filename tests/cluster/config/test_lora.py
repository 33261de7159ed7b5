"""ServeConfig's LoRA fields: the forms lora_modules takes (flags, JSON, YAML), their checks
naming the field, the flags, the YAML round trip and the EngineArgs they become."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from cluster.cli.flags import add_serve_flags, config_from_flags
from cluster.config import ServeConfig
from cluster.config.lora import LoraModule
from workers.config import EngineArgs


def _flags(*argv: str) -> ServeConfig:
    parser = argparse.ArgumentParser()
    add_serve_flags(parser, "127.0.0.1")
    return config_from_flags(parser.parse_args(list(argv)))


def test_off_by_default_and_the_engine_args_say_so() -> None:
    c = ServeConfig()
    assert c.lora.lora_modules is None and not c.lora.enable_lora and not c.lora.enable_runtime_lora
    args = EngineArgs(**c.engine_kwargs("/ckpt"))
    assert not args.enable_lora and not args.enable_expert_parallel
    assert (args.max_loras, args.max_lora_rank, args.max_cpu_loras) == (8, 64, None)


@pytest.mark.parametrize(
    "kwargs",
    [{"enable_lora": True}, {"lora_modules": ["a=/x"]}, {"enable_runtime_lora": True}],
)
def test_adapters_or_runtime_loading_turn_lora_on(kwargs: dict, demo_dir: Path) -> None:
    c = ServeConfig.from_flat(**kwargs, max_loras=2, max_cpu_loras=3)
    args = EngineArgs(**c.engine_kwargs(str(demo_dir)))
    assert args.enable_lora and (args.max_loras, args.max_cpu_loras) == (2, 3)
    lora = args.create_config().lora  # the engine's own LoRA limits accept them
    assert lora is not None and (lora.max_loras, lora.max_cpu_loras) == (2, 3)


def test_every_form_of_an_adapter() -> None:
    c = ServeConfig.from_flat(
        lora_modules=[
            "a=/x/a",
            '{"name": "b", "path": "/x/b", "base_model_name": "kvray-demo"}',
            {"name": "c", "path": "/x/c=1"},  # a YAML mapping; '=' in a path is kept
            LoraModule("d", "/x/d"),
        ]
    )
    assert c.lora.lora_modules == (
        LoraModule("a", "/x/a"),
        LoraModule("b", "/x/b", "kvray-demo"),
        LoraModule("c", "/x/c=1"),
        LoraModule("d", "/x/d"),
    )
    assert ServeConfig.from_flat(lora_modules="a=/x/a").lora.lora_modules == (
        LoraModule("a", "/x/a"),
    )
    assert ServeConfig.from_flat(lora_modules=[]).lora.lora_modules is None


def test_yaml_round_trip() -> None:
    c = ServeConfig.from_flat(
        lora_modules=["a=/x/a", '{"name": "b", "path": "/x/b"}'], max_lora_rank=16
    )
    text = yaml.safe_dump(c.to_args())  # no tuples or dataclasses: YAML-safe
    assert yaml.safe_load(text)["lora_modules"] == [
        {"name": "a", "path": "/x/a"},
        {"name": "b", "path": "/x/b"},
    ]
    assert ServeConfig.from_args(yaml.safe_load(text)) == c


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"lora_modules": ["a"]}, r"^lora_modules\[0\] must be NAME=PATH"),
        ({"lora_modules": ["=/x"]}, r"^lora_modules\[0\]\.name must be a non-empty"),
        ({"lora_modules": ["a="]}, r"^lora_modules\[0\]\.path must be a non-empty"),
        ({"lora_modules": ['{"name": "a"']}, r"^lora_modules\[0\] must be NAME=PATH or a JSON"),
        ({"lora_modules": [{"name": "a", "path": "/x", "rank": 8}]}, r"unknown keys \['rank'\]"),
        ({"lora_modules": 3}, r"^lora_modules must be a list"),
        ({"lora_modules": ["a=/x", "a=/y"]}, r"^lora_modules\[1\]\.name \('a'\) is given twice"),
        ({"lora_modules": ["kvray-demo=/x"]}, r"^lora_modules\[0\]\.name .* served model"),
        (
            {"lora_modules": [{"name": "a", "path": "/x", "base_model_name": "other"}]},
            r"^lora_modules\[0\]\.base_model_name \('other'\) is not the served model",
        ),
        ({"max_loras": 0}, r"^max_loras must be an integer >= 1"),
        ({"max_lora_rank": "64"}, r"^max_lora_rank must be an integer >= 1"),
        ({"max_loras": 4, "max_cpu_loras": 2}, r"^max_cpu_loras must be an integer >= max_loras"),
        ({"enable_runtime_lora": "yes"}, r"^enable_runtime_lora must be a boolean"),
        ({"enable_expert_parallel": 1}, r"^enable_expert_parallel must be a boolean"),
    ],
)
def test_bad_values_name_the_field(args: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServeConfig.from_args(args)


def test_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    c = _flags(
        "--lora-modules",
        "a=adapters/a",
        '{"name": "b", "path": "/abs/b"}',
        "--max-loras",
        "4",
        "--max-lora-rank",
        "16",
        "--max-cpu-loras",
        "6",
        "--enable-runtime-lora",
        "--enable-expert-parallel",
    )
    # Paths on the command line are this machine's: made absolute, as --model is.
    assert c.lora.lora_modules == (
        LoraModule("a", str(tmp_path / "adapters/a")),
        LoraModule("b", "/abs/b"),
    )
    assert (c.lora.max_loras, c.lora.max_lora_rank, c.lora.max_cpu_loras) == (4, 16, 6)
    assert c.lora.enable_runtime_lora and c.engine.enable_expert_parallel and not c.lora.enable_lora
    assert EngineArgs(**c.engine_kwargs("/m")).enable_lora  # implied
    assert _flags("--enable-lora").lora.enable_lora
    with pytest.raises(ValueError, match=r"lora_modules\[0\] must be NAME=PATH"):
        _flags("--lora-modules", "nopath")


def test_help_groups_the_lora_flags(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_serve_flags(parser, "127.0.0.1")
    parser.print_help()
    text = capsys.readouterr().out
    section = text[text.index("LoRA adapters:") :]
    for flag in ("--lora-modules NAME=PATH [NAME=PATH ...]", "--enable-runtime-lora"):
        assert flag in section
    assert "--max-lora-rank MAX_LORA_RANK" in section and "(default 64)" in section


def test_kvray_serve_checks_local_adapter_directories(tmp_path: Path) -> None:
    there = tmp_path / "a"
    there.mkdir()
    assert ServeConfig.from_flat(lora_modules=[f"a={there}"]).lora.modules_missing() is None
    gone = tmp_path / "b"
    missing = ServeConfig.from_flat(lora_modules=[f"a={there}", f"b={gone}"])
    assert missing.lora.modules_missing() == f"lora_modules[1] (b): {gone}: no such directory"

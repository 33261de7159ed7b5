"""The engine section: model names, and the settings it hands the engine as they are."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.config import ServeConfig
from cluster.config.engine import EngineSettings
from cluster.config.setting import declared
from workers.config import EngineArgs


def test_model_name() -> None:
    assert ServeConfig.from_flat(model="/ckpt/Qwen3-0.6B/").engine.model_name() == "Qwen3-0.6B"
    assert (
        ServeConfig.from_flat(model="/ckpt/x", served_model_name="prod").engine.model_name()
        == "prod"
    )


def test_engine_settings_are_engine_args_of_the_same_name() -> None:
    engine_args = {f.name for f in dataclasses.fields(EngineArgs)}
    passed = EngineSettings().engine_args()
    assert passed and set(passed) <= engine_args
    # Every other setting of the section reaches the engine some other way (engine_kwargs).
    others = {f.name for f, s in declared(EngineSettings) if not s.engine}
    assert others == {"model", "served_model_name", "device", "kv_share_gib"}


def test_kv_share_reaches_the_engine_as_kv_share_and_kv_events() -> None:
    on = ServeConfig.from_flat(kv_share_gib=1, kv_offload_gib=1).engine_kwargs("/m")
    assert on["kv_share"] and on["kv_events"]
    off = ServeConfig.from_flat(kv_offload_gib=1).engine_kwargs("/m")
    assert not off["kv_share"] and not off["kv_events"]


def test_kv_share_needs_the_host_tier() -> None:
    with pytest.raises(ValueError, match=r"^kv_share_gib needs kv_offload_gib > 0"):
        EngineSettings(kv_share_gib=1)
    with pytest.raises(ValueError, match=r"^kv_share_gib must be a number >= 0"):
        EngineSettings(kv_share_gib=-1, kv_offload_gib=1)


def test_the_section_checks_itself() -> None:
    with pytest.raises(ValueError, match=r"^async_scheduling needs tensor_parallel_size 1"):
        EngineSettings(async_scheduling=True, tensor_parallel_size=2)


def test_kv_offload_gib_flag_reaches_the_engine(demo_dir) -> None:  # noqa: ANN001
    import argparse

    from cluster.cli.flags import add_serve_flags, config_from_flags

    parser = argparse.ArgumentParser()
    add_serve_flags(parser, "127.0.0.1")
    assert config_from_flags(parser.parse_args([])).engine.kv_offload_gib == 0  # off
    c = config_from_flags(parser.parse_args(["--kv-offload-gib", "2.5"]))
    kwargs = c.engine_kwargs(str(demo_dir))
    assert kwargs["kv_offload_gib"] == 2.5
    assert EngineArgs(**kwargs).create_config().cache.kv_offload_gib == 2.5
    assert ServeConfig.from_args(c.to_args()) == c
    for bad in (-1, "1", True, float("inf")):
        with pytest.raises(ValueError, match=r"^kv_offload_gib "):
            ServeConfig.from_flat(kv_offload_gib=bad)

"""The chart's LoRA values (docs/lora.md) in the Serve config it renders."""

from __future__ import annotations

from tests.helm.helpers import only, serve_config


def test_lora_values_reach_the_app_only_when_set(render):
    """lora.* become the app's LoRA args (docs/lora.md), which ServeConfig accepts as
    `kvray serve --lora-modules ...` would give them; unset, the args say nothing about LoRA."""
    from cluster.config import ServeConfig
    from cluster.config.lora import LoraModule

    args = serve_config(only(render(None), "RayService"))["applications"][0]["args"]
    assert not {k for k in args if "lora" in k or "expert" in k}
    values = {
        "engine": {"enableExpertParallel": True},
        "lora": {
            "modules": [
                {"name": "sql", "path": "/models/adapters/sql"},
                {"name": "chat", "path": "/models/adapters/chat", "baseModelName": "kvray-demo"},
            ],
            "maxLoras": 4,
            "maxCpuLoras": 16,
            "runtimeLoading": True,
        },
    }
    args = serve_config(only(render(values), "RayService"))["applications"][0]["args"]
    config = ServeConfig.from_args(args)
    assert config.lora.lora_modules == (
        LoraModule("sql", "/models/adapters/sql"),
        LoraModule("chat", "/models/adapters/chat", "kvray-demo"),
    )
    assert (
        config.lora.enable_runtime_lora
        and config.lora.enable_lora
        and config.engine.enable_expert_parallel
    )
    assert (config.lora.max_loras, config.lora.max_lora_rank, config.lora.max_cpu_loras) == (
        4,
        64,
        16,
    )
    # Runtime loading alone turns LoRA on, with no adapters.
    args = serve_config(only(render({"lora": {"runtimeLoading": True}}), "RayService"))
    config = ServeConfig.from_args(args["applications"][0]["args"])
    assert config.lora.enable_runtime_lora and config.lora.lora_modules is None

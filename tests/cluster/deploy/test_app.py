"""build_app: a pure builder from config to bound deployments (no Ray instance needed)."""

from __future__ import annotations

import os

import pytest
from ray import serve

from cluster.config import ServeConfig
from cluster.deploy.app import (
    PREFILL_SERVER_NAME,
    build_app,
    ingress_options,
    llm_server_options,
    prefill_server_options,
)
from cluster.routing.router import ROUTER_CLASS_PATH


def test_build_app_from_yaml_args() -> None:
    app = build_app({"num_replicas": 2, "device": "cpu"})
    assert isinstance(app, serve.Application)
    with pytest.raises(ValueError, match="unknown kvray application args"):
        build_app({"replicas": 2})


def test_llm_server_reserves_its_tp_group_through_a_placement_group() -> None:
    cpu = llm_server_options(ServeConfig.from_flat(tensor_parallel_size=2, device="cpu"))
    assert cpu["placement_group_bundles"] == [{"CPU": 1}, {"CPU": 1}]
    assert cpu["placement_group_strategy"] == "STRICT_PACK"
    assert cpu["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 0}
    gpu = llm_server_options(ServeConfig.from_flat(tensor_parallel_size=4, device="cuda"))
    assert gpu["placement_group_bundles"] == [{"CPU": 1, "GPU": 1}] * 4
    # TP > 1: every rank is an actor in its own bundle; the replica holds no GPU itself.
    assert gpu["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 0}
    # TP = 1: the rank runs in the replica, which must fit in bundle 0 with its GPU.
    one = llm_server_options(ServeConfig.from_flat(tensor_parallel_size=1, device="cuda"))
    assert one["placement_group_bundles"] == [{"CPU": 1, "GPU": 1}]
    assert one["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 1}


def test_replica_reserves_num_cpus_per_replica() -> None:
    cpu = llm_server_options(ServeConfig.from_flat(num_cpus_per_replica=4, device="cpu"))
    actor = cpu["ray_actor_options"]
    assert (actor["num_cpus"], actor["num_gpus"]) == (4, 0)
    assert cpu["placement_group_bundles"] == [{"CPU": 4}]  # the replica sits in bundle 0
    # TP > 1: the other ranks' actors still take one CPU each.
    tp = llm_server_options(
        ServeConfig.from_flat(num_cpus_per_replica=3, tensor_parallel_size=2, device="cuda")
    )
    assert tp["placement_group_bundles"] == [{"CPU": 3, "GPU": 1}, {"CPU": 1, "GPU": 1}]
    assert tp["ray_actor_options"] == {"num_cpus": 3, "num_gpus": 0}


def test_replicas_autoscaling_and_router() -> None:
    fixed = llm_server_options(ServeConfig.from_flat(num_replicas=3, device="cpu"))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["name"] == "LLMServer" and fixed["max_ongoing_requests"] == 256
    assert fixed["request_router_config"].request_router_class == ROUTER_CLASS_PATH
    # The router hashes prompts in the engine's KV blocks: it gets the config's block size.
    assert fixed["request_router_config"].request_router_kwargs == {"block_size": 16}
    wide = llm_server_options(ServeConfig.from_flat(block_size=32, device="cpu"))
    assert wide["request_router_config"].request_router_kwargs == {"block_size": 32}
    auto = llm_server_options(ServeConfig.from_flat(min_replicas=1, max_replicas=5, device="cpu"))
    assert "num_replicas" not in auto
    assert auto["autoscaling_config"]["max_replicas"] == 5
    pow2 = llm_server_options(ServeConfig.from_flat(request_router="power_of_two", device="cpu"))
    assert "PowerOfTwo" in str(pow2["request_router_config"].request_router_class)


def test_prefill_replicas_are_a_deployment_of_their_own() -> None:
    config = ServeConfig.from_flat(
        prefill_replicas=2,
        min_replicas=1,
        max_replicas=4,
        kv_offload_gib=0.1,
        kv_share_gib=0.1,
        tensor_parallel_size=2,
        device="cpu",
    )
    opts = prefill_server_options(config)
    # A fixed count of the same replicas; the decode replicas (LLMServer) autoscale.
    assert opts["name"] == PREFILL_SERVER_NAME and opts["num_replicas"] == 2
    assert "autoscaling_config" not in opts
    assert opts["placement_group_bundles"] == [{"CPU": 1}, {"CPU": 1}]
    assert llm_server_options(config)["autoscaling_config"]["max_replicas"] == 4
    # Both ingresses get the prefill deployment: the HTTP one as its fourth argument, the
    # gRPC one (its third) as its fourth.
    _, llm, grpc, prefill = build_app(config)._bound_deployment.init_args
    assert prefill._bound_deployment.name == PREFILL_SERVER_NAME
    assert llm._bound_deployment.name == "LLMServer"
    assert grpc._bound_deployment.init_args[3] is prefill
    _, _, _, none = build_app(config.replace(prefill_replicas=0))._bound_deployment.init_args
    assert none is None


def test_prefill_replicas_can_autoscale_on_their_waiting_prompt_tokens() -> None:
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.config import AutoscalingConfig

    from cluster.controller.autoscaling import ScalingTargets

    tier = {"kv_offload_gib": 0.1, "kv_share_gib": 0.1, "device": "cpu"}
    config = ServeConfig.from_flat(
        prefill_replicas=1, prefill_max_replicas=3, target_prefill_queued_tokens=4096, **tier
    )
    opts = prefill_server_options(config)
    assert "num_replicas" not in opts  # the decode replicas' fixed count is theirs
    serve_cfg = AutoscalingConfig(**opts["autoscaling_config"])
    assert (serve_cfg.min_replicas, serve_cfg.max_replicas) == (1, 3)
    policy = _resolve_policy_callable(serve_cfg.policy)
    assert policy.targets == ScalingTargets(
        target_waiting_requests=4.0,
        target_kv_cache_usage=1.0,
        upscale_delay_s=10.0,
        downscale_delay_s=120.0,
        target_queued_tokens=4096.0,
    )
    with pytest.raises(ValueError, match="prefill_max_replicas"):
        ServeConfig.from_flat(prefill_replicas=2, prefill_max_replicas=1, **tier)
    with pytest.raises(ValueError, match="target_prefill_queued_tokens"):
        ServeConfig.from_flat(prefill_replicas=1, target_prefill_queued_tokens=0, **tier)


def test_ingress_options() -> None:
    opts = ingress_options(ServeConfig.from_flat(ingress_replicas=2))
    assert opts["name"] == "OpenAIIngress" and opts["num_replicas"] == 2
    assert opts["max_ongoing_requests"] > 256  # never the queue in front of the engines


def test_build_app_is_a_serve_application_builder() -> None:
    """`serve deploy` calls an import_path builder with exactly one argument (the config's
    `args:` mapping) and refuses any other signature."""
    import inspect

    assert len(inspect.signature(build_app).parameters) == 1


def test_the_operators_openmp_wait_settings_reach_cpu_replicas() -> None:
    """OpenMP's wait settings where the app is built reach a CPU replica's process (its engine
    child and TP ranks inherit them) when it computes on 2+ torch threads; none by default
    (libgomp's own spin: docs/benchmarks.md, "Threads and OpenMP waiting")."""
    from cluster.config import ServeConfig
    from cluster.deploy.app import cpu_threads_env

    two = ServeConfig.from_flat(device="cpu", num_cpus_per_replica=2)
    passive = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}
    assert cpu_threads_env(two, False, {}) == {}
    assert cpu_threads_env(two, False, {**passive, "PATH": "/bin"}) == passive
    assert cpu_threads_env(two, True, passive) == {}
    assert cpu_threads_env(ServeConfig.from_flat(device="cpu"), False, passive) == {}
    actor = llm_server_options(two)["ray_actor_options"]
    settings = cpu_threads_env(two, False, os.environ)
    assert actor.get("runtime_env") == ({"env_vars": settings} if settings else None)
    assert (
        "runtime_env"
        not in llm_server_options(ServeConfig.from_flat(device="cpu"))["ray_actor_options"]
    )

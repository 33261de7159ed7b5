"""build_app: the kvray Serve application from a ServeConfig (the only place that binds).

Usable as a Serve config `import_path: cluster.app:build_app` with `args:` = ServeConfig
fields. Pure: validates, builds deployment options and binds; starts nothing.

    OpenAIIngress (HTTP, route "/")  ──handle──▶  LLMServer × N  (prefix-affinity router)
    GrpcIngress (own gRPC server)    ──handle──▶  (the same LLMServer deployment)
    with --prefill-replicas P, both  ──handle──▶  LLMServerPrefill × P (prefill, then LLMServer)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from cluster.config import ServeConfig
from cluster.deploy.serve_env import GRACEFUL_SHUTDOWN_WAIT_LOOP_S
from cluster.ray_internals import pin_code_version
from cluster.replica.llm_server import LLMServer
from cluster.routing.kv_router import KV_ROUTER_CLASS_PATH
from cluster.routing.router import ROUTER_CLASS_PATH, ROUTING_STATS_PERIOD_S

LLM_SERVER_NAME = "LLMServer"
# The prefill replicas' deployment, with --prefill-replicas (cluster/ingress/pd.py).
PREFILL_SERVER_NAME = "LLMServerPrefill"
INGRESS_NAME = "OpenAIIngress"
# An ingress replica only parses, tokenizes and relays; it must never be the bottleneck that
# queues requests in front of the engines (Ray Serve's default cap is 5).
INGRESS_MAX_ONGOING_REQUESTS = 4096
# A replica must not take longer than this to drain on shutdown or redeploy.
GRACEFUL_SHUTDOWN_TIMEOUT_S = 30.0


def build_app(args: Mapping[str, Any] | ServeConfig | None = None) -> serve.Application:
    """The application: OpenAIIngress and GrpcIngress bound to one LLMServer deployment.

    One parameter, as Serve requires of an application builder (`serve deploy` calls it with
    the config's `args:` mapping)."""
    config = args if isinstance(args, ServeConfig) else ServeConfig.from_args(args)
    return _bind(config, draining=False)


def build_run_app(
    config: ServeConfig, code_version: str, draining: bool = False
) -> serve.Application:
    """The application as `kvray serve` deploys it: every deployment with the code version of
    this `kvray serve` process. Deployed again with `draining=True` over the running one, it
    only reconfigures the HTTP ingress replicas (a user_config change; /ready 503), which is
    how a graceful shutdown begins: nothing restarts, no model is loaded again."""
    return _bind(config, draining, code_version)


def _bind(
    config: ServeConfig, draining: bool, code_version: str | None = None
) -> serve.Application:
    from cluster.grpc_api.ingress import bind_grpc_ingress
    from cluster.http.ingress import OpenAIIngress

    llm = pin_code_version(serve.deployment(LLMServer, **llm_server_options(config)), code_version)
    llm_node = llm.bind(config)
    prefill_node = None
    if config.pd.prefill_replicas:
        # The same replica class, its own deployment: routed, scaled and stopped apart.
        opts = prefill_server_options(config)
        prefill_node = pin_code_version(serve.deployment(LLMServer, **opts), code_version).bind(
            config
        )
    # The gRPC ingress runs its own server; binding it into the HTTP ingress's arguments is
    # what makes Serve deploy it as part of this application.
    grpc = bind_grpc_ingress(config, llm_node, code_version=code_version, prefill=prefill_node)
    ingress = pin_code_version(
        serve.deployment(OpenAIIngress, **ingress_options(config, draining)), code_version
    )
    return ingress.bind(config, llm_node, grpc, prefill_node)


def prefill_server_options(config: ServeConfig) -> dict[str, Any]:
    """Deployment options of the prefill replicas (cluster/ingress/pd.py): LLMServer's, with
    a fixed count of their own or their own autoscaling."""
    opts = llm_server_options(config)
    for decode_only in ("autoscaling_config", "num_replicas"):
        opts.pop(decode_only, None)
    opts["name"] = PREFILL_SERVER_NAME
    autoscaling = config.pd.serve_autoscaling(config.autoscaling)
    if autoscaling is not None:  # on the prompt tokens waiting (cluster/config/pd.py)
        return {**opts, "autoscaling_config": autoscaling}
    return {**opts, "num_replicas": config.pd.prefill_replicas}


def uses_gpu(config: ServeConfig) -> bool:
    """device auto: GPUs when the Ray cluster has any (set `device: cuda` for GPU nodes that
    an autoscaler has not started yet)."""
    if config.engine.device != "auto":
        return config.engine.device == "cuda"
    import ray

    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0


def llm_server_options(config: ServeConfig) -> dict[str, Any]:
    """Deployment options of LLMServer: replicas, TP placement group, router, health."""
    gpu = uses_gpu(config)
    # One bundle per TP rank, packed on one node; the replica actor itself sits in bundle 0.
    # TP = 1 runs the rank in the replica process, which then holds the GPU; TP > 1 runs every
    # rank as a Ray actor in its bundle (workers/executor/ray_executor.py), so the replica
    # takes none.
    # Bundle 0 holds the replica actor and its `num_cpus_per_replica` CPUs (its torch threads
    # follow them); every other rank's actor takes one CPU.
    bundle = {"CPU": 1, "GPU": 1} if gpu else {"CPU": 1}
    first = {**bundle, "CPU": config.replicas.num_cpus_per_replica}
    replica_gpus = 1 if gpu and config.engine.tensor_parallel_size == 1 else 0
    if config.replicas.request_router == "prefix_affinity":
        router = RequestRouterConfig(
            request_router_class=ROUTER_CLASS_PATH,
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
            # Prefix keys hash whole KV blocks: the router must use the engine's block size.
            request_router_kwargs={"block_size": config.engine.block_size},
        )
    elif config.replicas.request_router == "kv_events":
        router = RequestRouterConfig(
            request_router_class=KV_ROUTER_CLASS_PATH,
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
            # The router hashes prompts into the engine's own block hashes; with the cluster
            # KV tier, what one replica holds the others can pull.
            request_router_kwargs={
                "block_size": config.engine.block_size,
                "kv_share": config.engine.kv_share_gib > 0,
            },
        )
    else:  # Serve's default power-of-two-choices; stats still feed dashboards and benches
        router = RequestRouterConfig(request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)
    actor: dict[str, Any] = {
        "num_cpus": config.replicas.num_cpus_per_replica,
        "num_gpus": replica_gpus,
    }
    threads_env = cpu_threads_env(config, gpu, os.environ)
    if threads_env:
        actor["runtime_env"] = {"env_vars": threads_env}
    opts: dict[str, Any] = {
        "name": LLM_SERVER_NAME,
        "max_ongoing_requests": config.replicas.max_ongoing_requests,
        # Bounds the queue in each caller's router too: requests not yet handed to a replica.
        # A burst that the replicas can take (max_ongoing_requests each) passes; admission
        # control proper is the replica's own waiting-queue cap (max_queued_requests).
        "max_queued_requests": config.replicas.max_ongoing_requests
        + config.limits.max_queued_requests,
        "ray_actor_options": actor,
        "placement_group_bundles": [first]
        + [dict(bundle) for _ in range(1, config.engine.tensor_parallel_size)],
        "placement_group_strategy": "STRICT_PACK",
        "request_router_config": router,
        "health_check_period_s": 5.0,
        "health_check_timeout_s": 30.0,
        # Stopped (scale-down, redeploy): in-flight requests run on for this long; Serve then
        # kills the replica and the ingresses move what is left elsewhere (migration).
        "graceful_shutdown_timeout_s": config.replicas.graceful_shutdown_timeout_s,
        "graceful_shutdown_wait_loop_s": GRACEFUL_SHUTDOWN_WAIT_LOOP_S,
    }
    autoscaling = config.autoscaling_config()
    if autoscaling is not None:
        opts["autoscaling_config"] = autoscaling
    else:
        opts["num_replicas"] = config.replicas.num_replicas
    return opts


# How OpenMP's idle threads wait: spinning (libgomp's default) or asleep (PASSIVE).
_OMP_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def cpu_threads_env(config: ServeConfig, gpu: bool, environ: Mapping[str, str]) -> dict[str, str]:
    """The OpenMP wait settings of the environment that builds the app, for a CPU replica
    computing on several torch threads; empty by default.

    Measured with 2 threads per replica (docs/benchmarks.md, "Threads and OpenMP
    waiting"): libgomp's
    default spin gives 20-25 % more serving throughput than OMP_WAIT_POLICY=PASSIVE on cores
    the replica has to itself, for ~15 % more CPU per token; on a host that other work keeps
    busy, spinning wastes cores that others need, so an operator there sets PASSIVE. Set
    where the app is built, it reaches the replica's process through Ray's runtime env even
    on a remote cluster (its engine child and TP rank actors inherit it; OpenMP reads it when
    torch loads). One thread has nobody to wait for; a GPU replica's threads do little."""
    if gpu or config.replicas.torch_threads() < 2:
        return {}
    return {k: environ[k] for k in _OMP_WAIT_VARS if k in environ}


def ingress_options(config: ServeConfig, draining: bool = False) -> dict[str, Any]:
    return {
        # Changing only this redeploys nothing: Serve calls OpenAIIngress.reconfigure.
        "user_config": {"draining": draining},
        "name": INGRESS_NAME,
        "num_replicas": config.replicas.ingress_replicas,
        "max_ongoing_requests": INGRESS_MAX_ONGOING_REQUESTS,
        # Light work (parsing, tokenizing): do not hold a CPU a replica could use.
        "ray_actor_options": {"num_cpus": 0},
        # The ingress carries the streams of engine replicas being stopped with it: it waits
        # at least as long as they do.
        "graceful_shutdown_timeout_s": max(
            GRACEFUL_SHUTDOWN_TIMEOUT_S, config.replicas.graceful_shutdown_timeout_s
        ),
        "graceful_shutdown_wait_loop_s": GRACEFUL_SHUTDOWN_WAIT_LOOP_S,
    }

"""The gRPC ingress: kvray.v1.LLMService, grpc.health.v1.Health and reflection on one port.

Why a deployment running its own grpc.aio server instead of Ray Serve's gRPC proxy
(`grpc_options.grpc_servicer_functions`), after reading Ray 2.60's proxy
(ray/serve/_private/proxy.py, grpc_util.py):

- Health: the proxy answers only its own /ray.serve.RayServeAPIService/Healthz. A
  grpc.health.v1 servicer registered through it is routed like any user method to the app's
  ingress deployment, which cannot see the proxy draining, so NOT_SERVING while draining
  is out of reach (only reflection is served in-process, via a private passthrough list).
- Routing: the proxy sends every method to the application's single ingress deployment.
  That is the HTTP ingress here, and a second application would need the `application`
  metadata key on every call, which Kubernetes gRPC probes and grpcurl users do not send.
- Size limit: the proxy's receive limit is RAY_SERVE_GRPC_MAX_MESSAGE_SIZE (2 GiB), read from
  the environment when the proxy actor starts, for every application; ours is a per-app
  setting (`grpc_max_message_bytes`, 4 MiB) enforced by the transport before decoding.
- Deadlines reach the proxy but not the replica; cancellation works through both paths.

So GrpcIngress binds the port itself and calls LLMServer through a DeploymentHandle, exactly
as the HTTP ingress does: same request router, same LLMServer code path. The port and host
stay where Serve users look for them: `grpc_options.port` (9000) and `http_options.host`
of the Serve config, read from the Serve controller when the replica starts. `grpc_options`
below keeps Serve's own gRPC proxy off that port (no servicer functions = no proxy server).

Placement: replicas run on the head node (where `kvray serve` listens and where a KubeRay
head service exposes port 9000); with `ingress_replicas` > 1 they share the port through
SO_REUSEPORT and the kernel spreads connections over them.

Lifecycle: health is NOT_SERVING until LLMServer has answered once, then SERVING; when Ray
Serve stops the replica (scale-down, redeploy, `serve shutdown`), health turns NOT_SERVING
for `drain_s` while the listener still accepts (probes and load balancers notice), then the
server stops taking new calls and gives in-flight ones `grace_s` to finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from cluster.config import ServeConfig
from cluster.deploy.serve_env import GRACEFUL_SHUTDOWN_WAIT_LOOP_S
from cluster.ray_internals import HEAD_NODE_RESOURCE

logger = logging.getLogger("kvray.grpc")

GRPC_INGRESS_NAME = "GrpcIngress"
# Ray Serve's default `grpc_options.port` (docs/contracts.md's port table); the one literal: the CLI
# flags import it. tests/cluster/test_ray_internals.py checks it against gRPCOptions().
DEFAULT_GRPC_PORT = 9000
LLM_SERVICE = "kvray.v1.LLMService"
READY_RETRY_S = 1.0


@dataclass(frozen=True)
class GrpcSettings:
    """Where and how the gRPC server listens. None: take it from the Serve config."""

    host: str | None = None  # None: Serve's http_options.host ("127.0.0.1" for kvray serve)
    port: int | None = None  # None: Serve's grpc_options.port (9000)
    max_message_bytes: int = 4 * 1024 * 1024  # larger request messages: RESOURCE_EXHAUSTED
    drain_s: float = 5.0  # NOT_SERVING before the listener closes, on shutdown (--grpc-drain-s)
    grace_s: float = 20.0  # then in-flight RPCs get this long to finish
    pin_to_head: bool = True

    @staticmethod
    def from_config(config: ServeConfig, **overrides: Any) -> GrpcSettings:
        base = {
            "max_message_bytes": config.network.grpc_max_message_bytes,
            "drain_s": config.network.grpc_drain_s,
        }
        return GrpcSettings(**{**base, **overrides})


def grpc_options(port: int = DEFAULT_GRPC_PORT) -> dict[str, Any]:
    """Serve's `grpc_options` for kvray: the port GrpcIngress binds, and no servicer functions
    so that Serve's own gRPC proxy does not start on it (see the module docstring)."""
    return {"port": port, "grpc_servicer_functions": []}


def grpc_ingress_options(config: ServeConfig, settings: GrpcSettings) -> dict[str, Any]:
    """Deployment options of GrpcIngress."""
    actor: dict[str, Any] = {"num_cpus": 0}
    if settings.pin_to_head:
        actor["resources"] = {HEAD_NODE_RESOURCE: 0.001}
    return {
        "name": GRPC_INGRESS_NAME,
        "num_replicas": config.replicas.ingress_replicas,
        "ray_actor_options": actor,
        # Serve waits this long for __del__ (drain + grace) before killing the replica.
        "graceful_shutdown_timeout_s": settings.drain_s + settings.grace_s + 5.0,
        "graceful_shutdown_wait_loop_s": GRACEFUL_SHUTDOWN_WAIT_LOOP_S,
        "health_check_period_s": 5.0,
    }


def bind_grpc_ingress(
    config: ServeConfig,
    llm: Any,
    settings: GrpcSettings | None = None,
    code_version: str | None = None,
    prefill: Any = None,
) -> Any:
    """GrpcIngress bound to the LLMServer deployment (a bound node or a DeploymentHandle),
    and to the prefill replicas' deployment when there is one (`prefill`).

    Pass the result to the HTTP ingress's bind so Serve deploys it in the same application.
    `code_version`: see cluster.deploy.app.build_run_app (None: Serve derives one).
    """
    from ray import serve

    from cluster.ray_internals import pin_code_version

    settings = settings or GrpcSettings.from_config(config)
    deployment = serve.deployment(GrpcIngress, **grpc_ingress_options(config, settings))
    return pin_code_version(deployment, code_version).bind(config, llm, settings, prefill)


class GrpcIngress:
    """One gRPC server in one Serve replica. Serve routes no requests to it."""

    async def __init__(
        self, config: ServeConfig, llm: Any, settings: GrpcSettings, prefill: Any = None
    ) -> None:
        import grpc.aio
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc
        from grpc_reflection.v1alpha import reflection

        from cluster.config import resolve_tokenizer
        from cluster.grpc_api.servicer import LLMServicer
        from cluster.grpc_api.tracing import trace_interceptors
        from cluster.ingress.limits import RequestLimits
        from cluster.ingress.lora_catalog import LoraCatalog
        from cluster.ingress.output_parsing import OutputParsing
        from cluster.ingress.pd import pd_client_kwargs
        from cluster.ingress.route_spans import route_spans
        from cluster.ingress.tenant_gate import TenantGate
        from cluster.ingress.tenants import TenantAuth
        from cluster.routing.metrics import RouterMetrics
        from kvray.v1 import llm_pb2_grpc
        from workers.tokenizer import Tokenizer

        self._settings = settings
        host, port = await _listen_address(settings)
        spans = route_spans(config, GRPC_INGRESS_NAME)  # tracing; None: off
        tokenizer = await asyncio.to_thread(Tokenizer.from_pretrained, resolve_tokenizer(config))
        self._servicer = LLMServicer(
            llm,
            tokenizer,
            served_model=config.engine.model_name(),
            auth=TenantAuth.from_config(config),  # API keys and tenants
            gate=TenantGate.from_config(config),  # tenants' quotas and metrics
            metrics=RouterMetrics(),
            limits=RequestLimits.from_config(config),
            max_migrations=config.replicas.max_migrations,
            queue_timeout_s=config.limits.queue_timeout_s,
            spans=spans,
            lora=LoraCatalog.from_config(config),  # the model's LoRA adapters
            pd=pd_client_kwargs(config, prefill),  # disaggregation (None: no prefill replicas)
            parsing=OutputParsing.of(config.parsing, tokenizer),  # tool-call format, reasoning
        )
        self._health = health.aio.HealthServicer()
        self._serving_status = health_pb2.HealthCheckResponse.SERVING
        for service in ("", LLM_SERVICE):
            await self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)

        self._server = grpc.aio.server(
            interceptors=trace_interceptors(spans),
            options=[
                ("grpc.max_receive_message_length", settings.max_message_bytes),
                ("grpc.so_reuseport", 1),
            ],
        )
        llm_pb2_grpc.add_LLMServiceServicer_to_server(self._servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection(
            (LLM_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server
        )
        address = (
            f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
        )
        if config.network.tls:
            credentials = await asyncio.to_thread(_tls_credentials, config)
            self._server.add_secure_port(address, credentials)
        else:
            self._server.add_insecure_port(address)
        await self._server.start()
        self._ready_task = asyncio.get_running_loop().create_task(self._become_ready())
        self._drain_task: asyncio.Task[None] | None = None
        logger.info(
            "gRPC ingress listening on %s%s (reflection, grpc.health.v1)",
            address,
            " over TLS" if config.network.tls else "",
        )

    async def _become_ready(self) -> None:
        """SERVING once LLMServer answers (the engine is loaded and a replica is routable)."""
        while True:
            try:
                await self._servicer.model_card()
                break
            except Exception as err:  # not deployed yet, or restarting
                logger.info("gRPC ingress waiting for LLMServer: %s", err)
                await asyncio.sleep(READY_RETRY_S)
        for service in ("", LLM_SERVICE):
            await self._health.set(service, self._serving_status)
        logger.info("gRPC ingress SERVING")

    async def drain(self) -> None:
        """NOT_SERVING for drain_s, then stop: no new calls, in-flight ones get grace_s."""
        if self._drain_task is None:
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())
        await asyncio.shield(self._drain_task)

    async def _drain(self) -> None:
        self._ready_task.cancel()
        await self._health.enter_graceful_shutdown()  # every service NOT_SERVING, for good
        logger.info("gRPC ingress draining: NOT_SERVING for %.1fs", self._settings.drain_s)
        await asyncio.sleep(self._settings.drain_s)
        await self._server.stop(self._settings.grace_s)
        logger.info("gRPC ingress stopped")

    async def __del__(self) -> None:
        # Serve awaits this on graceful shutdown (Python's own finalizer would only create
        # the coroutine; the server is gone with the process then anyway).
        with contextlib.suppress(Exception):
            await self.drain()


def _tls_credentials(config: ServeConfig) -> Any:
    """Server credentials from the PEM files the config names (read on this node)."""
    from pathlib import Path

    import grpc

    assert config.network.tls_cert_file is not None and config.network.tls_key_file is not None
    key = Path(config.network.tls_key_file).read_bytes()
    chain = Path(config.network.tls_cert_file).read_bytes()
    return grpc.ssl_server_credentials([(key, chain)])


async def _listen_address(settings: GrpcSettings) -> tuple[str, int]:
    """(host, port) from the settings, else from the running Serve instance's options."""
    host, port = settings.host, settings.port
    if host is None or port is None:
        from cluster.ray_internals import serve_grpc_options, serve_http_options

        # Serve keeps http_options / grpc_options in its controller; see ray_internals.
        if host is None:
            host = (await serve_http_options()).host or "0.0.0.0"
        if port is None:
            grpc_port = (await serve_grpc_options()).port
            port = grpc_port if grpc_port > 0 else DEFAULT_GRPC_PORT
    return host, port

"""Every private Ray (Serve) internal kvray relies on, in one place, each with why.

Ray's public surface covers most of what kvray does (`ray.serve.request_router`:
RequestRouter, RunningReplica, PendingRequest, ReplicaID, `curr_replicas`,
`replica_queue_len_cache`; `ray.serve.config.gRPCOptions`; `ray.util.metrics`). What is
left below has no public equivalent in Ray 2.60. `pyproject.toml` pins `ray[serve]` to the
minor version these were read from, and tests/cluster/test_ray_internals.py fails
loudly when an upgrade changes a name, a signature or a constant this module relies on:
run it first after raising the pin, then fix what it reports here and nowhere else.

Ray is imported inside the functions: this module sits under `kvray --help`'s imports.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    from ray.serve.config import HTTPOptions, gRPCOptions
    from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica
    from ray.util.metrics import Counter

# -- placement ----------------------------------------------------------------------------------

# Ray's built-in resource of the head node (`node:__internal_head__`): a sliver of it pins an
# actor there (the LoRA registry, the KV directory, the gRPC ingress).
HEAD_NODE_RESOURCE = "node:__internal_head__"
# The Ray namespace of kvray's own detached actors, found by name from any replica.
KVRAY_NAMESPACE = "kvray"

# -- metrics ------------------------------------------------------------------------------------


def record_zero(counter: Counter, tags: dict[str, str]) -> None:
    """Create a counter's series at 0 so rate()/increase() see its first increment.

    Relies on `ray.util.metrics.Metric._record(value, tags=None)`: the public
    `Counter.inc()` refuses 0 and calls `_record` after that check. Without a series at 0 a
    series is born at its first increment's value and Prometheus counts none of it (a lone
    429 or preemption would never show).
    """
    counter._record(0.0, tags=tags)


# -- deployments --------------------------------------------------------------------------------


def pin_code_version(deployment: Any, code_version: str | None) -> Any:
    """The deployment with a fixed code version (None: left to Serve, which derives one from
    a Serve config and draws one per `serve.run`); returns it.

    Relies on `Deployment._version`, which `serve.run` reads as `deployment._version or
    get_random_string()` (the public `version` option was removed). Without it every
    `serve.run` is new code to Serve and restarts every replica: `kvray serve`'s drain notice,
    the same application with only the HTTP ingress's user_config changed, would replace the
    engine replicas (loading the model again) before the ingress could turn draining.
    """
    if code_version is not None:
        deployment._version = code_version
    return deployment


# -- the driver's console -----------------------------------------------------------------------


def wrap_forwarded_log_printer(wrap: Callable[[Callable[..., None]], Callable[..., None]]) -> bool:
    """Wraps the handler that prints on this driver's console the log lines Ray's processes
    forward to it (ray.init's `log_to_driver`) with `wrap`; whether it could.

    Relies on `ray._private.ray_logging.global_worker_stdstream_dispatcher.handlers`, a list of
    (name, handler) pairs in which "ray_print_logs" prints each forwarded batch. No public hook
    filters forwarded lines by level (`log_to_driver=False` drops the warnings too). One
    reference swap: no batch is printed by neither handler or by both.
    """
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return False
    pairs = list(getattr(dispatcher, "handlers", ()))
    if "ray_print_logs" not in [name for name, _ in pairs]:  # log_to_driver off, or Ray changed
        return False
    dispatcher.handlers = [(n, wrap(h) if n == "ray_print_logs" else h) for n, h in pairs]
    return True


def session_logs_dir() -> str | None:
    """The logs directory of the Ray session this process is connected to, or None.

    Relies on `ray._private.worker._global_node.get_logs_dir_path()`: no public API names the
    directory (it holds the session's date, so `session_latest` is only a link to it).
    """
    try:
        import ray._private.worker as ray_worker

        node = ray_worker._global_node
        return None if node is None else node.get_logs_dir_path()
    except (ImportError, AttributeError):
        return None


# -- request routing ----------------------------------------------------------------------------


def ask_for_backoff(pending_request: PendingRequest) -> None:
    """Make Serve sleep (with backoff) between routing rounds in which no rank took the request.

    Relies on `PendingRequest.routing_context.should_backoff` (RequestRoutingContext is not a
    public class; Ray's own experimental routers set this flag the same way). Without it the
    routing loop spins and starves the event loop it runs on.
    """
    pending_request.routing_context.should_backoff = True


class FulfillOwnRequest:
    """RequestRouter mixin: the replica a routing task chose goes to that task's own request.

    Serve's base class hands a chosen replica to the pending request whose *internal request
    id* matches, but every handle call made while serving one ingress request shares that id
    (e.g. the prompts of a batched /v1/completions): Serve indexes only the first of them, so
    the replica picked for prompt B's prefix would go to prompt A and B would never be routed.
    The routing task itself knows which request it works on: `choose_replicas` is called from
    that task with its request (`remember_request`), and the same task then calls
    `_fulfill_next_pending_request` with the replica it chose.

    Relies on, in `ray.serve._private.request_router.request_router.RequestRouter`:
    - `_fulfill_next_pending_request(replica, request_metadata=None)`: the hook the routing
      loop calls, in the routing task, once a replica is chosen (overridden here);
    - `_record_queue_wait_time(pending_request)`: Serve's router fulfillment-time histogram;
    - `_remove_pending_request_from_indices(pending_request)`: drops the request from
      Serve's by-id index, which would otherwise keep every request routed here.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # routing task -> the request it routes; a finished task drops its entry.
        self._kvray_routing: weakref.WeakKeyDictionary[asyncio.Task[Any], PendingRequest] = (
            weakref.WeakKeyDictionary()
        )

    def remember_request(self, pending_request: PendingRequest | None) -> None:
        """Call from choose_replicas: the current routing task works on `pending_request`."""
        task = asyncio.current_task()
        if pending_request is not None and task is not None:
            self._kvray_routing[task] = pending_request

    def own_request(self) -> PendingRequest | None:
        """The not yet routed request of the current routing task, if any."""
        task = asyncio.current_task()
        pr = self._kvray_routing.get(task) if task is not None else None
        return pr if pr is not None and not pr.future.done() else None

    def _fulfill_next_pending_request(
        self, replica: RunningReplica, request_metadata: Any = None
    ) -> None:
        router: Any = self
        pr = self.own_request()
        if pr is None:
            super()._fulfill_next_pending_request(replica, request_metadata)  # type: ignore[misc]
            return
        router._record_queue_wait_time(pr)
        pr.future.set_result(replica)
        router._remove_pending_request_from_indices(pr)


# -- the Serve instance -------------------------------------------------------------------------


def _serve_controller() -> Any:
    """The Serve controller actor.

    Relies on `ray.serve._private.constants.SERVE_CONTROLLER_NAME` / `SERVE_NAMESPACE`: Serve
    keeps http_options / grpc_options in its controller and has no public getter for them
    inside a replica; Serve's own replicas and proxies find the controller this way.
    """
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    return ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)


async def serve_http_options() -> HTTPOptions:
    """The running Serve instance's http_options (controller method `get_http_config`)."""
    return await _serve_controller().get_http_config.remote()


async def serve_grpc_options() -> gRPCOptions:
    """The running Serve instance's grpc_options (controller method `get_grpc_config`)."""
    return await _serve_controller().get_grpc_config.remote()


# -- Serve types without a public constructor (tests, tools) ------------------------------------


def deployment_id(name: str, app_name: str) -> Any:
    """A `ray.serve._private.common.DeploymentID`: the public ReplicaID and Serve's errors
    (DeploymentUnavailableError) take one, and Ray exports no public constructor for it."""
    from ray.serve._private.common import DeploymentID

    return DeploymentID(name=name, app_name=app_name)


def request_metadata(request_id: str, internal_request_id: str | None = None) -> Any:
    """A `ray.serve._private.common.RequestMetadata`, what a public PendingRequest carries."""
    from ray.serve._private.common import RequestMetadata

    return RequestMetadata(
        request_id=request_id, internal_request_id=internal_request_id or request_id
    )


def standalone_router(router_cls: type[RequestRouter], name: str, app_name: str) -> Any:
    """A RequestRouter built outside a handle (unit tests: no Ray cluster needed).

    Its constructor takes `deployment_id` and `handle_source`, both Serve-private types
    (`DeploymentID`, `DeploymentHandleSource`); Serve builds routers the same way.
    """
    from ray.serve._private.common import DeploymentHandleSource

    return router_cls(
        deployment_id=deployment_id(name, app_name),
        handle_source=DeploymentHandleSource.UNKNOWN,
        use_replica_queue_len_cache=True,
    )


# -- KV-event routing tests ---------------------------------------------------------------------


def handle_request_router(handle: Any) -> RequestRouter | None:
    """The RequestRouter instance behind a DeploymentHandle routed on Serve's own thread
    (`_init(_run_router_in_separate_loop=True)`), so a test can read a KV-event router's index.

    Relies on `DeploymentHandle._router` (a SingletonThreadRouter), its `_asyncio_router`
    (AsyncioRouter) and that one's `request_router` property: Serve exposes no public way
    to reach the router a handle built.
    """
    return handle._router._asyncio_router.request_router


def built_request_router(handle: Any) -> RequestRouter | None:
    """The RequestRouter a DeploymentHandle has built, or None before its first call; never
    builds one (Serve builds it lazily on first use, on its own thread).

    Relies on the same private attributes as `handle_request_router`, and on the
    AsyncioRouter's `_request_router` behind its lazy `request_router` property.
    """
    router = getattr(handle, "_router", None)
    inner = getattr(router, "_asyncio_router", None)
    return getattr(inner, "_request_router", None)


def owned_actor_pids(owner_pid: int, class_name: str) -> list[int]:
    """Processes of the live actors of `class_name` that the actor in process `owner_pid`
    created (a replica's TP rank actors: a test kills one of a given replica's).

    Reads the GCS actor table through `ray._private.state.actors()` (the public state API
    needs the dashboard, which tests run without): each entry's owner address is the
    creating worker's, whose port identifies it."""
    from ray._private import state

    table = state.actors().values()
    owner = [a for a in table if a["Pid"] == owner_pid and a["State"] == "ALIVE"]
    if len(owner) != 1:
        return []
    port = owner[0]["Address"]["Port"]
    return [
        a["Pid"]
        for a in table
        if a["State"] == "ALIVE"
        and a["ActorClassName"] == class_name
        and a["OwnerAddress"]["Port"] == port
    ]


def replica_actor(app_name: str, deployment: str, unique_id: str) -> Any:
    """The actor of one Serve replica (a test kills it to make Serve start a new one).

    Relies on `ReplicaID.to_full_id_str()` being the replica actor's name and on
    `ray.serve._private.constants.SERVE_NAMESPACE`, where Serve creates its actors.
    """
    import ray
    from ray.serve._private.constants import SERVE_NAMESPACE
    from ray.serve.request_router import ReplicaID

    rid = ReplicaID(unique_id=unique_id, deployment_id=deployment_id(deployment, app_name))
    return ray.get_actor(rid.to_full_id_str(), namespace=SERVE_NAMESPACE)


# -- object store -------------------------------------------------------------------------------


def object_store_stats() -> dict[str, int]:
    """The object store's bytes in use, its capacity and what it spilled to disk, summed over
    the cluster's nodes: what the cluster KV tier's budget is checked against (tests, `kvray
    bench kv-tier`). Ray's public API has no equivalent (the state API needs the dashboard);
    `ray memory --stats-only` prints the same reply. Asks the instance this process is
    connected to: found by itself, Ray refuses when another instance runs on the machine
    ("multiple active Ray instances")."""
    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    address = ray.get_runtime_context().gcs_address if ray.is_initialized() else None
    stats = get_memory_info_reply(get_state_from_address(address)).store_stats
    return {
        "bytes_used": int(stats.object_store_bytes_used),
        "bytes_avail": int(stats.object_store_bytes_avail),
        "spilled_bytes": int(stats.spilled_bytes_total),
    }

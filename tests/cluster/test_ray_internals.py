"""What cluster/ray_internals.py relies on in Ray, checked without a Ray cluster.

A failure here after a Ray upgrade names the internal that moved: fix ray_internals.py (and
only it), then raise the `ray[serve]` pin in pyproject.toml.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import ray
from packaging.requirements import Requirement
from packaging.version import Version
from ray.serve.config import gRPCOptions
from ray.serve.request_router import PendingRequest, RequestRouter
from ray.util.metrics import Counter, Metric

from cluster import ray_internals
from cluster.grpc_api.ingress import DEFAULT_GRPC_PORT, grpc_options
from cluster.routing.router import PrefixAffinityRouter, request_routing_key
from tests.cluster.routing.routing_kit import generate_request, pending, replicas, router

REPO = Path(__file__).resolve().parents[2]


def _params(fn: Any) -> list[tuple[str, Any]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


def _ray_requirement() -> Requirement:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (req,) = [Requirement(d) for d in deps if Requirement(d).name == "ray"]
    return req


def test_installed_ray_is_inside_the_pin() -> None:
    req = _ray_requirement()
    assert "serve" in req.extras
    # A pin, not a floor: an upper bound below the next minor version.
    assert any(s.operator == "<" for s in req.specifier), f"ray is not pinned: {req}"
    assert Version(ray.__version__) in req.specifier, (
        f"installed Ray {ray.__version__} is outside pyproject's {req}: run this file against "
        "it, fix cluster/ray_internals.py, then move the pin"
    )
    # The container image installs the Ray it names: it must be inside the pin too.
    image = re.search(r"^ARG RAY_VERSION=(\S+)$", (REPO / "Dockerfile").read_text(), re.M)
    assert image is not None
    assert Version(image.group(1)) in req.specifier


# -- metrics ------------------------------------------------------------------------------------


def test_counter_record() -> None:
    assert _params(Metric._record) == [
        ("self", inspect.Parameter.empty),
        ("value", inspect.Parameter.empty),
        ("tags", None),
    ]
    counter = Counter("kvray_test_ray_internals_total", "test", tag_keys=("k",))
    # Still needed: the public inc() refuses 0 (when it accepts 0, use it instead).
    with pytest.raises(ValueError):
        counter.inc(0, tags={"k": "v"})
    ray_internals.record_zero(counter, {"k": "v"})  # no Ray needed: recorded or discarded


# -- deployments --------------------------------------------------------------------------------


def test_pinned_code_version_reaches_serve_run() -> None:
    from ray import serve
    from ray.serve._private import client

    class Noop:
        pass

    assert ray_internals.pin_code_version(serve.deployment(Noop), None)._version is None
    deployment = ray_internals.pin_code_version(serve.deployment(Noop), "v1")
    assert deployment._version == "v1"
    # serve.run reads the attribute (else a random version: every replica restarts).
    assert "deployment._version or get_random_string()" in inspect.getsource(client)
    with pytest.raises(ValueError):  # still no public way (when there is one, use it instead)
        serve.deployment(Noop, version="v1")


# -- the driver's console -----------------------------------------------------------------------


def test_forwarded_log_printer_hook() -> None:
    import ray._private.worker as ray_worker
    from ray._private.node import Node
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    # ray.init(log_to_driver=True) registers the printer under this name on the dispatcher.
    assert isinstance(dispatcher.handlers, list)
    assert '"ray_print_logs"' in inspect.getsource(ray_worker)
    assert hasattr(ray_worker, "_global_node") and callable(Node.get_logs_dir_path)
    before = list(dispatcher.handlers)
    printed: list[object] = []
    dispatcher.handlers = [*before, ("ray_print_logs", printed.append)]
    try:
        assert ray_internals.wrap_forwarded_log_printer(
            lambda h: lambda data: h({**data, "seen": True})
        )
        dict(dispatcher.handlers)["ray_print_logs"]({"lines": ["x"]})
        assert printed == [{"lines": ["x"], "seen": True}]
    finally:
        dispatcher.handlers = before


# -- request routing ----------------------------------------------------------------------------


def test_request_router_hooks() -> None:
    empty = inspect.Parameter.empty
    assert _params(RequestRouter._fulfill_next_pending_request) == [
        ("self", empty),
        ("replica", empty),
        ("request_metadata", None),
    ]
    assert _params(RequestRouter._record_queue_wait_time) == [
        ("self", empty),
        ("pending_request", empty),
    ]
    assert _params(RequestRouter._remove_pending_request_from_indices) == [
        ("self", empty),
        ("pending_request", empty),
    ]
    # The public surface the router uses, for good measure.
    assert _params(RequestRouter.choose_replicas) == [
        ("self", empty),
        ("candidate_replicas", empty),
        ("pending_request", None),
    ]
    assert [n for n, _ in _params(RequestRouter.on_request_routed)] == [
        "self",
        "pending_request",
        "replica_id",
        "result",
    ]
    assert isinstance(RequestRouter.curr_replicas, property)
    assert isinstance(RequestRouter.replica_queue_len_cache, property)
    assert {"queue_len_response_deadline_s", "max_queue_len_response_deadline_s"} <= set(
        dir(RequestRouter)
    )
    # The mixin's override is the one Serve's routing loop reaches.
    mro = PrefixAffinityRouter.__mro__
    assert mro.index(ray_internals.FulfillOwnRequest) < mro.index(RequestRouter)


def test_routing_context_backoff_flag() -> None:
    async def go() -> None:
        pr = pending({"routing_key": "k"})
        assert pr.routing_context.should_backoff is False
        ray_internals.ask_for_backoff(pr)
        assert pr.routing_context.should_backoff is True

    asyncio.run(go())


def test_shared_internal_request_id_each_gets_its_preferred_replica() -> None:
    """Serve's routing loop with our router, end to end in one process (stub replicas).

    Two handle calls of one ingress request (same internal request id, different prompts)
    must each be routed, each to its own preferred replica. This holds only while Serve's
    loop calls choose_replicas and `_fulfill_next_pending_request` from the same routing
    task, which is what FulfillOwnRequest relies on.
    """

    async def go() -> None:
        r = router()
        reps = replicas(4, max_ongoing_requests=100)
        r.update_replicas(reps)  # type: ignore[arg-type]
        await asyncio.sleep(0.05)  # the queue-length probes of the new replicas
        requests = [generate_request([t] * 64, request_id=f"p{t}") for t in range(100, 108)]
        prs: list[PendingRequest] = [pending(req, "one-ingress-request") for req in requests]
        # `_choose_replica_for_request` is how Serve's Router enters the routing loop.
        chosen = await asyncio.wait_for(
            asyncio.gather(*(r._choose_replica_for_request(pr) for pr in prs)), timeout=10
        )
        for pr, replica in zip(prs, chosen, strict=True):
            key = request_routing_key(pr.args[0], r._opts)
            assert key is not None
            assert replica is r._preferred(reps, pr)  # type: ignore[arg-type]
            assert r.routing_decision(pr, replica.replica_id) == "affinity"
        # Nothing routed stays in Serve's index.
        assert not r._pending_requests_by_id

    asyncio.run(go())


# -- the Serve instance -------------------------------------------------------------------------


def test_serve_controller_lookup() -> None:
    from ray.serve._private import constants
    from ray.serve._private.controller import ServeController
    from ray.serve.config import HTTPOptions

    assert constants.SERVE_CONTROLLER_NAME == "SERVE_CONTROLLER_ACTOR"
    assert constants.SERVE_NAMESPACE == "serve"
    hints = {
        "get_http_config": HTTPOptions,
        "get_grpc_config": gRPCOptions,
    }
    for name, returns in hints.items():
        method = getattr(ServeController, name)
        assert _params(method) == [("self", inspect.Parameter.empty)]
        assert inspect.signature(method).return_annotation in (returns, returns.__name__)


def test_serve_still_reads_the_env_vars_kvray_sets() -> None:
    # cluster/deploy/serve_env.py tunes Serve through environment variables, several of them
    # undocumented; a renamed one would be silently ignored after an upgrade.
    from ray.serve._private import constants

    from cluster.deploy.serve_env import LOCAL_SERVE_ENV, SERVE_ENV

    source = Path(inspect.getfile(constants)).read_text()
    missing = [k for k in {**SERVE_ENV, **LOCAL_SERVE_ENV} if f'"{k}"' not in source]
    assert not missing, f"Ray Serve no longer reads {missing}"


def test_grpc_port_default_is_serves() -> None:
    assert gRPCOptions().port == DEFAULT_GRPC_PORT
    # What kvray passes as Serve's grpc_options is a valid gRPCOptions without servicers.
    opts = gRPCOptions(**grpc_options(1234))
    assert opts.port == 1234 and opts.grpc_servicer_functions == []


# -- Serve types without a public constructor ---------------------------------------------------


def test_private_constructors() -> None:
    did = ray_internals.deployment_id("LLMServer", "kvray")
    assert (did.name, did.app_name) == ("LLMServer", "kvray")
    meta = ray_internals.request_metadata("rid", "internal")
    assert (meta.request_id, meta.internal_request_id) == ("rid", "internal")
    assert ray_internals.request_metadata("rid").internal_request_id == "rid"
    r = ray_internals.standalone_router(PrefixAffinityRouter, "LLMServer", "kvray")
    assert r.app_name == "kvray" and r.curr_replicas == {}


# -- object store -------------------------------------------------------------------------------


def test_object_store_stats_reply() -> None:
    from ray._private import internal_api
    from ray.core.generated import node_manager_pb2

    assert _params(internal_api.get_state_from_address) == [("address", None)]
    assert _params(internal_api.get_memory_info_reply)[0][0] == "state"
    fields = {f.name for f in node_manager_pb2.ObjectStoreStats.DESCRIPTOR.fields}
    assert {"object_store_bytes_used", "object_store_bytes_avail", "spilled_bytes_total"} <= fields
    reply = node_manager_pb2.FormatGlobalMemoryInfoReply()
    assert isinstance(reply.store_stats, node_manager_pb2.ObjectStoreStats)

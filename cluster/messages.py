"""The typed message an ingress sends to an LLMServer replica (through a DeploymentHandle).

An ingress checks a request once, into the engine's own types (`workers.inputs.EngineInput`:
token ids against the vocabulary and max_model_len, SamplingParams validated, the output
kind set), before it is routed; what is behind the handle trusts it. The prefix-affinity
router (cluster/routing/router.py) reads `routing_key`, `input.prompt_token_ids` and
`prefer_node_id` from the pending request's first argument.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from workers.inputs import EngineInput


@dataclass(frozen=True)
class GenerateRequest:
    """One engine request: `LLMServer.generate(request)` streams its RequestOutputs."""

    request_id: str  # unique per engine request (n > 1 samples share it; prompts do not)
    input: EngineInput  # checked: the replica runs it as is
    routing_key: str | None = None  # explicit affinity key; None: hash of the prompt blocks
    # time.time() when the ingress built it: the time spent before a replica took it (Serve's
    # router queue) counts toward the replica's queue_timeout_s.
    sent_at: float = field(default_factory=time.time)
    # Migration (cluster/ingress/migration.py): how many times this request moved to another
    # replica, and the replicas it failed on (the routers pass them over while others live).
    migration: int = 0
    exclude_replicas: frozenset[str] = frozenset()
    # Tracing (cluster/tracing.py): the W3C carrier ({"traceparent", "tracestate"}) of the
    # span this request's replica span hangs under; None when the ingress does not trace.
    trace_context: dict[str, str] | None = None
    # Disaggregation (cluster/ingress/pd.py): "prefill" on a prefill replica (publish the
    # prompt's KV blocks before the output that ends it), "decode" on the decode replica that
    # continues it (pull them, whatever the cost model says); None: an ordinary request.
    handoff: str | None = None
    # Kubernetes inference gateways (cluster/http/gateway_hint.py): the Ray node id of the pod
    # the gateway's endpoint picker chose; the routers prefer a replica there that has room.
    # None: no preference.
    prefer_node_id: str | None = None

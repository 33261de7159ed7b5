"""The figures a replica's KV cost model starts from, before it has measured its own
(cluster/replica/kv_cost.py), and that an ingress assumes for a replica that has not
published its measurements yet (cluster/ingress/pd_cost.py). Each is chosen to favour
moving KV over recomputing it, so that the first moves happen and get measured."""

from __future__ import annotations

# Ray's object store on one node moves GB/s; a CPU prefill does thousands of tokens/s;
# an actor call on the head node takes a millisecond or two.
PRIOR_PULL_BYTES_PER_S = 2e9
PRIOR_PULL_OVERHEAD_S = 0.002
PRIOR_LOOKUP_S = 0.002
PRIOR_PREFILL_TOKENS_PER_S = 2000.0
# An engine step's fixed cost: a step of the demo model on one CPU core takes a few ms.
PRIOR_STEP_S = 0.01

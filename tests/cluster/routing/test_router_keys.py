"""Prompt keys of the prefix-affinity router under LoRA adapters (cluster/routing/router_keys.py);
the keys' and rendezvous' other properties are tested in test_router.py."""

from __future__ import annotations

import hashlib
from array import array

from cluster.routing.router_keys import prefix_routing_key

BLOCK = 16


def test_an_adapter_salts_the_key() -> None:
    ids = list(range(1000, 1064))
    base = prefix_routing_key(ids, BLOCK, 4)
    one, two = (prefix_routing_key(ids, BLOCK, 4, salt=s) for s in (1, 2))
    assert len({base, one, two}) == 3
    # Still a key of the first full blocks only: what follows them changes nothing.
    assert prefix_routing_key(ids + [5] * 20, BLOCK, 4, salt=1) == one
    assert prefix_routing_key(ids[:10], BLOCK, 4, salt=1) is None
    # The base model's key is as before adapters existed: routers of two versions agree.
    assert base == hashlib.blake2b(array("q", ids).tobytes(), digest_size=8).hexdigest()

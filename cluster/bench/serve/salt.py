"""Each backend's copy of a `kvray bench serve` round's workload: backends measured one after
another on one server must not find their prompts in the prefix cache another one filled."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from cluster.bench.common.workload import Workload


def salt_workload(workload: Workload, slot: int, token_ids: Sequence[int]) -> Workload:
    """The same requests with every prompt's first token set to token_ids[slot]: one slot per
    backend in a run, so no backend is served from the prefix cache another one filled on the
    same server (prefix-cache blocks are hashed as a chain from the first token: nothing
    after a differing first token matches). Everything else stays: prompt and output lengths,
    shared tenant prefixes within the workload, so each backend does the same work."""
    salt = token_ids[slot % len(token_ids)]
    requests = tuple(
        replace(r, prompt_ids=(salt, *r.prompt_ids[1:])) if r.prompt_ids else r
        for r in workload.requests
    )
    return Workload(workload.name, requests, {**workload.params, "prompt_salt": slot})

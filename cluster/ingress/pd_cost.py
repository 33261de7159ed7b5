"""`auto`'s per-request choice: prefill here or on a prefill replica, by the delay each adds.

A request's prompt costs its replica time to compute, and that time is a delay to everyone
there: the request's own first token, the first tokens of the requests waiting behind it,
and every token of the streams that replica is decoding (chunked prefill runs the prompt
inside their steps). So each way is scored as the sum of the delays it adds, in seconds:

    local = ttft_local + (running_d + waiting_d) x compute_d
            ttft_local = (queued_tokens_d + compute_d tokens) / rate_d + a step
    pd    = ttft_pd + waiting_p x compute_p + running_d x resume_d
            ttft_pd    = (queued_tokens_p + compute_p tokens) / rate_p
                         + HANDOFF_TOKENS prefill steps + the pull of the prompt's blocks
                         + the decode replica's resume step

where compute_x is what replica x would compute of the prompt (the prompt less the blocks
its prefix cache holds, and, with the cluster tier on, less the blocks a peer holds, which
it pulls instead), and resume_d what the decode replica still computes after the hand-off
(the prompt's last partial block and the tokens the prefill returned). Each side takes its
best replica. The request is disaggregated when `pd` is the smaller: short prompts on an idle
decode replica and prompts mostly cached there stay local; a long prompt beside running
streams moves; and a short one moves too when the decode replica is busy and a prefill
replica is idle (its prompt then costs the streams almost nothing), which keeps the prefill
replicas working on a short-prompt mix.

The inputs are live: each replica's queue, running sequences and cached blocks as its
router sees them (cluster/routing/replica_loads.py), and its own measured prefill rate,
step time and pull rate (cluster/replica/kv_cost.py), published in its routing stats.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cluster.kv_priors import (
    PRIOR_PREFILL_TOKENS_PER_S,
    PRIOR_PULL_BYTES_PER_S,
    PRIOR_PULL_OVERHEAD_S,
    PRIOR_STEP_S,
)


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica as a router sees it, for one prompt."""

    cached_tokens: int = 0  # of the prompt: held in its prefix cache
    pullable_tokens: int = 0  # past those: held by a peer (the cluster tier pulls them)
    queued_tokens: int = 0  # prompt tokens waiting there, before this request
    running: int = 0  # sequences it decodes
    waiting: int = 0  # requests waiting for it
    prefill_tokens_per_s: float = PRIOR_PREFILL_TOKENS_PER_S
    step_s: float = PRIOR_STEP_S  # a step's fixed cost
    pull_bytes_per_s: float = PRIOR_PULL_BYTES_PER_S
    pull_overhead_s: float = PRIOR_PULL_OVERHEAD_S
    kv_bytes_per_token: int = 0  # over every rank (0: unknown; a pull costs its overhead)

    def compute_s(self, tokens: int) -> float:
        return max(tokens, 0) / self.prefill_tokens_per_s

    def pull_s(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        return self.pull_overhead_s + tokens * self.kv_bytes_per_token / self.pull_bytes_per_s

    def own_s(self, prompt: int) -> float:
        """This replica's time to hold the whole prompt: the pull of what a peer holds, the
        computation of the rest."""
        computed = prompt - self.cached_tokens - self.pullable_tokens
        return self.pull_s(self.pullable_tokens) + self.compute_s(computed)


@dataclass(frozen=True)
class PdEstimate:
    """Both ways' added delay for one request (module doc); `disaggregate` picks."""

    local_s: float
    pd_s: float

    @property
    def disaggregate(self) -> bool:
        return self.pd_s < self.local_s


def estimate(
    prompt: int,
    decode: Sequence[ReplicaLoad],
    prefill: Sequence[ReplicaLoad],
    *,
    block_size: int,
    handoff_tokens: int,
) -> PdEstimate | None:
    """The estimate for a prompt of `prompt` tokens; None without a replica on either side."""
    if not decode or not prefill:
        return None
    handed = prompt // block_size * block_size

    def local(d: ReplicaLoad) -> float:
        own = d.own_s(prompt)
        return d.compute_s(d.queued_tokens) + own + d.step_s + (d.running + d.waiting) * own

    def remote(p: ReplicaLoad) -> float:
        own = p.own_s(prompt)
        ttft = p.compute_s(p.queued_tokens) + own + handoff_tokens * p.step_s
        return ttft + p.waiting * own

    def decode_side(d: ReplicaLoad) -> float:
        # The pull (no step of its own: the replica pulls before its engine sees the
        # request), then a step computing the unhanded tail and replaying the returned
        # tokens, after the prompts queued there; the streams wait for the tail only.
        tail = d.compute_s(prompt - handed + handoff_tokens)
        pull = d.pull_s(handed - d.cached_tokens)
        return pull + d.compute_s(d.queued_tokens) + d.step_s + tail + d.running * tail

    return PdEstimate(
        local_s=min(local(d) for d in decode),
        pd_s=min(remote(p) for p in prefill) + min(decode_side(d) for d in decode),
    )

"""Whether to pull a prompt's KV blocks from the cluster tier or compute them: the cheaper,
by this replica's own measured figures.

    pull    = overhead_s + bytes / pull_bytes_per_s
    compute = tokens / prefill_tokens_per_s

Both rates are learned online, as exponentially weighted averages of their inverses
(seconds per byte, seconds per token: the time a request waits is what the model compares,
and an average of rates would let one fast sample hide several slow ones). Every pull gives
its bytes and its whole cost (the replica's fetch and checks, then the engine's copy into its
host tier and back to the device: cluster/replica/kv_share.py), and every finished request
that computed its prompt gives the prefill rate (prompt tokens computed, not cached, over
the time from its first schedule to its first token, from the engine's RequestMetrics).
Until it has seen any, the model starts from priors that favour pulling (a fast local store,
a slow prefill), so the first pulls happen and are measured; a few slow ones correct them.
"""

from __future__ import annotations

from dataclasses import dataclass

# Priors: Ray's object store on one node moves GB/s; a CPU prefill does thousands of tokens/s.
PRIOR_PULL_BYTES_PER_S = 2e9
PRIOR_PULL_OVERHEAD_S = 0.002
PRIOR_PREFILL_TOKENS_PER_S = 2000.0
# Weight of the newest measurement.
ALPHA = 0.25
# Measurements smaller than these are mostly noise (a tiny prefill is all scheduling).
MIN_PREFILL_TOKENS = 32
# Pulls at least this large measure the transfer rate; smaller ones, the fixed cost.
LARGE_PULL_BYTES = 1 << 20


@dataclass
class PullCost:
    pull_bytes_per_s: float = PRIOR_PULL_BYTES_PER_S
    pull_overhead_s: float = PRIOR_PULL_OVERHEAD_S
    prefill_tokens_per_s: float = PRIOR_PREFILL_TOKENS_PER_S
    pulls_seen: int = 0
    prefills_seen: int = 0

    def pull_seconds(self, nbytes: int) -> float:
        return self.pull_overhead_s + nbytes / self.pull_bytes_per_s

    def compute_seconds(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    def worth_pulling(self, tokens: int, nbytes: int) -> bool:
        return self.pull_seconds(nbytes) < self.compute_seconds(tokens)

    def observe_pull(self, nbytes: int, seconds: float) -> None:
        """One pull of `nbytes` took `seconds`: the part past the overhead is the transfer."""
        seconds = max(seconds, 1e-6)
        if nbytes >= LARGE_PULL_BYTES:
            transfer = max(seconds - self.pull_overhead_s, seconds / 2)
            self.pull_bytes_per_s = _ewma_rate(self.pull_bytes_per_s, nbytes / transfer)
        else:  # a small pull is mostly its fixed cost
            fixed = max(0.0, seconds - nbytes / self.pull_bytes_per_s)
            self.pull_overhead_s = _ewma(self.pull_overhead_s, fixed)
        self.pulls_seen += 1

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= MIN_PREFILL_TOKENS and seconds > 0:
            self.prefill_tokens_per_s = _ewma_rate(self.prefill_tokens_per_s, tokens / seconds)
            self.prefills_seen += 1


def _ewma(old: float, new: float) -> float:
    return (1 - ALPHA) * old + ALPHA * new


def _ewma_rate(old: float, new: float) -> float:
    """The rate whose inverse is the weighted average of the inverses of `old` and `new`."""
    return 1.0 / _ewma(1.0 / old, 1.0 / new)

"""Whether to pull a prompt's KV blocks from the cluster tier or compute them: the cheaper,
by this replica's own measured figures.

    pull    = overhead_s + bytes / pull_bytes_per_s
    compute = tokens / prefill_tokens_per_s

Each figure is the median of this replica's last WINDOW measurements of it: a median, so
that neither a cold start's slow first requests nor one lucky fast one moves it, and recent,
so that it follows the replica's load. Every pull gives its bytes and its whole cost (the
replica's fetch and checks, then the engine's copy into its host tier and back to the
device: cluster/replica/kv_share.py); a small pull measures the fixed cost, a large one the
rate. Every finished request that computed its prompt gives the prefill rate (prompt tokens
computed, not cached, over the time from its first schedule to its first token, from the
engine's RequestMetrics). Until a figure is measured it is its prior, chosen to favour
pulling (a fast local store, a slow prefill), so the first pulls happen and are measured.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

# Priors: Ray's object store on one node moves GB/s; a CPU prefill does thousands of tokens/s.
PRIOR_PULL_BYTES_PER_S = 2e9
PRIOR_PULL_OVERHEAD_S = 0.002
PRIOR_PREFILL_TOKENS_PER_S = 2000.0
# Measurements each figure is the median of.
WINDOW = 16
# Measurements smaller than these are mostly noise (a tiny prefill is all scheduling).
MIN_PREFILL_TOKENS = 32
# Pulls at least this large measure the transfer rate; smaller ones, the fixed cost.
LARGE_PULL_BYTES = 1 << 20


def _window() -> deque[float]:
    return deque(maxlen=WINDOW)


@dataclass
class PullCost:
    pull_bytes_per_s: float = PRIOR_PULL_BYTES_PER_S
    pull_overhead_s: float = PRIOR_PULL_OVERHEAD_S
    prefill_tokens_per_s: float = PRIOR_PREFILL_TOKENS_PER_S
    pulls_seen: int = 0
    prefills_seen: int = 0
    _rates: deque[float] = field(default_factory=_window, repr=False)  # large pulls' bytes/s
    _fixed: deque[float] = field(default_factory=_window, repr=False)  # small pulls' fixed s
    _prefills: deque[float] = field(default_factory=_window, repr=False)  # tokens/s

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
            self._rates.append(nbytes / transfer)
            self.pull_bytes_per_s = statistics.median(self._rates)
        else:  # a small pull is mostly its fixed cost
            self._fixed.append(max(0.0, seconds - nbytes / self.pull_bytes_per_s))
            self.pull_overhead_s = statistics.median(self._fixed)
        self.pulls_seen += 1

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= MIN_PREFILL_TOKENS and seconds > 0:
            self._prefills.append(tokens / seconds)
            self.prefill_tokens_per_s = statistics.median(self._prefills)
            self.prefills_seen += 1

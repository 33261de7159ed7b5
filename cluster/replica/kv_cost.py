"""Whether to pull a prompt's KV blocks from the cluster tier or compute them: the cheaper,
by this replica's own measured figures.

    pull    = overhead_s + bytes / pull_bytes_per_s
    compute = tokens / prefill_tokens_per_s

A pull first asks the application's directory which blocks are published (lookup_s): the
replica looks up only when a pull of every missing block could beat computing them with the
lookup added, and once it has the answer the lookup is spent either way, so the pull is
weighed without it. Short prompts thus skip the round trip entirely.

Compute is the prefill's marginal cost: the step's fixed cost (scheduling, sampling the
first token) is paid either way, since the rest of the prompt is computed after a pull too.
Every finished request that computed its prompt gives a point (prompt tokens computed, not
cached; the time from its first schedule to its first token, from the engine's
RequestMetrics), and a line through the last WINDOW points, fitted robustly (Theil-Sen: the
median of the pairwise slopes, then the median intercept), gives the marginal rate and the
fixed cost; points all of one length give the rate alone. Every pull gives its bytes and its
whole cost: the replica's fetch and checks, then the engine's part, its time to the first
token less what the fit says the rest of the prompt took (cluster/replica/kv_share.py). A
small pull measures the fixed cost of pulling, a large one its rate, each the median of the
last WINDOW. Medians, so that neither a cold start's slow first requests nor one lucky fast
one moves a figure; recent ones, so that the figures follow the replica's load. Until a
figure is measured it is its prior, chosen to favour pulling (a fast local store, a slow
prefill), so the first pulls happen and are measured.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from cluster.kv_priors import (
    PRIOR_LOOKUP_S,
    PRIOR_PREFILL_TOKENS_PER_S,
    PRIOR_PULL_BYTES_PER_S,
    PRIOR_PULL_OVERHEAD_S,
)

# Measurements each figure is the median of.
WINDOW = 16
# Measurements smaller than these are mostly noise (a tiny prefill is all scheduling).
MIN_PREFILL_TOKENS = 32
# Pulls at least this large measure the transfer rate; smaller ones, the fixed cost.
LARGE_PULL_BYTES = 1 << 20
# Two prefills give a slope when their lengths differ by at least this factor: closer, the
# noise in their times would dominate it.
MIN_LENGTH_RATIO = 1.25


def _window() -> deque[float]:
    return deque(maxlen=WINDOW)


@dataclass
class PullCost:
    pull_bytes_per_s: float = PRIOR_PULL_BYTES_PER_S
    pull_overhead_s: float = PRIOR_PULL_OVERHEAD_S
    prefill_tokens_per_s: float = PRIOR_PREFILL_TOKENS_PER_S  # the marginal rate
    prefill_fixed_s: float = 0.0
    lookup_s: float = PRIOR_LOOKUP_S
    pulls_seen: int = 0
    prefills_seen: int = 0
    _rates: deque[float] = field(default_factory=_window, repr=False)  # large pulls' bytes/s
    _fixed: deque[float] = field(default_factory=_window, repr=False)  # small pulls' fixed s
    _prefills: deque[tuple[int, float]] = field(default_factory=_window, repr=False)
    _lookups: deque[float] = field(default_factory=_window, repr=False)

    def pull_seconds(self, nbytes: int) -> float:
        return self.pull_overhead_s + nbytes / self.pull_bytes_per_s

    def compute_seconds(self, tokens: int) -> float:
        """What computing `tokens` more prompt tokens adds to a request's first token."""
        return tokens / self.prefill_tokens_per_s

    def first_token_seconds(self, tokens: int) -> float:
        """A request's time from its schedule to its first token, computing `tokens`."""
        return self.prefill_fixed_s + self.compute_seconds(tokens)

    def worth_pulling(self, tokens: int, nbytes: int) -> bool:
        return self.pull_seconds(nbytes) < self.compute_seconds(tokens)

    def worth_looking_up(self, tokens: int, nbytes: int) -> bool:
        """Whether pulling all of `tokens` (`nbytes`), found at the cost of a lookup, could
        beat computing them."""
        return self.lookup_s + self.pull_seconds(nbytes) < self.compute_seconds(tokens)

    def observe_lookup(self, seconds: float) -> None:
        self._lookups.append(max(seconds, 0.0))
        self.lookup_s = statistics.median(self._lookups)

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
            self._prefills.append((tokens, seconds))
            self.prefill_fixed_s, per_token = _fit(self._prefills)
            self.prefill_tokens_per_s = 1.0 / per_token
            self.prefills_seen += 1


def _fit(points: deque[tuple[int, float]]) -> tuple[float, float]:
    """(fixed seconds, seconds per token) of a line through (tokens, seconds) points, robust
    to outliers (Theil-Sen); (0, median seconds per token) when their lengths are too alike
    or the slope comes out negative (noise)."""
    pts = list(points)
    slopes = [
        (s2 - s1) / (t2 - t1)
        for i, (t1, s1) in enumerate(pts)
        for t2, s2 in pts[i + 1 :]
        if max(t1, t2) >= MIN_LENGTH_RATIO * min(t1, t2)
    ]
    slope = statistics.median(slopes) if slopes else 0.0
    if slope <= 0:
        return 0.0, statistics.median(s / t for t, s in points)
    return max(0.0, statistics.median(s - slope * t for t, s in points)), slope

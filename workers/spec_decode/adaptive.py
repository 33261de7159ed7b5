"""How many draft tokens a sequence gets this step: as many as raise the engine's expected
tokens per second, from measured figures.

A step's time is modelled as `a + b * tokens` (a: the fixed cost of a step — Python, the
launch, reading every weight once; b: the cost of one more token in it), fitted online by
exponentially weighted least squares over the engine's own steps. Draft token j of a sequence
(1-based) is accepted with probability about alpha^j, alpha being the sequence's measured
per-token acceptance (an exponential average). Adding it to a step of N tokens that yields
about T tokens raises the expected tokens per second when

    alpha^j / b > T / (a + b * N),    i.e.    alpha^j > c = b * T / (a + b * N).

At small batches the fixed cost dominates (c near 0) and drafts are cheap; at large ones c
nears 1 and only near-certain drafts pass, so speculation switches itself off where verifying
costs more than it saves. The rule is per sequence: a sequence whose drafts keep failing
stops proposing, while a copying one keeps its full length.
"""

from __future__ import annotations

from dataclasses import dataclass

# Prior acceptance of a new sequence: drafts start at full length and the average moves
# towards what the sequence shows.
PRIOR_ACCEPTANCE = 0.7
ACCEPTANCE_WEIGHT = 0.3  # weight of the newest step in a sequence's acceptance average
# A sequence whose acceptance fell below the threshold still probes with one draft token every
# this many steps while drafts are cheap: its text may start repeating later (a quote, code).
PROBE_EVERY = 8


@dataclass
class SeqAcceptance:
    """One sequence's speculation state, owned by the engine's Speculator."""

    alpha: float = PRIOR_ACCEPTANCE
    steps_without: int = 0  # steps since it last got a draft

    def record(self, proposed: int, accepted: int) -> None:
        if proposed:
            rate = accepted / proposed
            self.alpha += ACCEPTANCE_WEIGHT * (rate - self.alpha)


class StepCost:
    """`seconds = a + b * tokens` over the recent steps (weighted least squares, decay)."""

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def record(self, tokens: int, seconds: float) -> None:
        d = self.decay
        self._w = d * self._w + 1.0
        self._x = d * self._x + tokens
        self._y = d * self._y + seconds
        self._xx = d * self._xx + tokens * tokens
        self._xy = d * self._xy + tokens * seconds

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b), or None until the steps seen differ enough in size to tell them apart."""
        w = self._w
        if w < 4.0:
            return None
        mx, my = self._x / w, self._y / w
        var = self._xx / w - mx * mx
        if var < 1.0:  # every step the same size: b cannot be told from a
            return None
        b = max((self._xy / w - mx * my) / var, 0.0)
        a = max(my - b * mx, 0.0)
        return a, b

    def threshold(self, step_tokens: int, step_yield: float) -> float:
        """c of the module doc for a step of `step_tokens` tokens yielding `step_yield`; 0.0
        while the model has no fit (speculate: the steps' sizes then vary and teach it)."""
        fit = self.coefficients()
        if fit is None:
            return 0.0
        a, b = fit
        cost = a + b * step_tokens
        return 0.0 if cost <= 0 else min(b * step_yield / cost, 1.0)


def draft_length(acceptance: SeqAcceptance, limit: int, threshold: float) -> int:
    """The largest j <= limit with alpha^j > threshold (module doc); 1 as a periodic probe."""
    j, p = 0, 1.0
    while j < limit:
        p *= acceptance.alpha
        if p <= threshold:
            break
        j += 1
    probe = acceptance.steps_without >= PROBE_EVERY and threshold < PRIOR_ACCEPTANCE
    if j == 0 and limit > 0 and probe:
        return 1
    return j

"""LLMServer's autoscaling policy: replicas from waiting requests and KV-cache usage.

Ray Serve's default policy scales on ongoing requests per replica, which says little about an
LLM engine: one replica runs 64 short requests at ease and chokes on 8 long ones whose KV
cache fills it. Each replica reports its own load through Serve's `record_autoscaling_stats`
hook (cluster/replica/llm_server.py): requests waiting (admitted, not yet running) and the
fraction of its KV cache in use. This policy asks for as many replicas as the more demanding
of the two signals needs at its per-replica target, plus the requests Serve's handles still
hold because no replica could take them (at zero replicas, all of them). Prefill replicas
(cluster/config/pd.py) add a third: the prompt tokens waiting on them, which is their work
(`target_queued_tokens`; None for the decode replicas, whose waiting prompts are a fraction
of what they do).

Hysteresis, so a burst's tail or one idle second does not flap the replica count:
- a band: replicas are added once a signal is over its target, but taken away only when the
  load would still sit under `downscale_fraction` of the target on fewer replicas;
- delays: the wish to go up (down) must hold for `upscale_delay_s` (`downscale_delay_s`)
  before it is acted on; a change of mind restarts the clock;
- never down while replicas are still starting: they have reported no load yet, and their
  silence is not idleness (a fresh deployment would otherwise stop its first replica).
Serve's own delays are set to 0 (cluster/config/autoscaling.py) so these are the only ones.
From zero replicas Serve itself starts one at the first request (its cold-start path),
without delay.

Serve pickles this module by value into its controller, whose import path may not hold the
kvray tree: it must import nothing from kvray, only the standard library.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# Names of the per-replica stats LLMServer.record_autoscaling_stats reports.
WAITING_STAT = "kvray_waiting_requests"
KV_USAGE_STAT = "kvray_kv_cache_usage"
QUEUED_TOKENS_STAT = "kvray_queued_prompt_tokens"
# Keys of this policy's own state in Serve's policy_state (Serve keeps its keys beside them).
_WANT = "kvray_want"
_SINCE = "kvray_want_since"


def scaling_stats(waiting: int, kv_usage: float, queued_tokens: int) -> dict[str, float]:
    """One replica's `record_autoscaling_stats`: its engine's waiting requests and KV-cache
    usage (the kvray_num_requests_waiting and kvray_kv_cache_usage_ratio gauges) and the
    prompt tokens waiting there."""
    return {
        WAITING_STAT: float(waiting),
        KV_USAGE_STAT: float(kv_usage),
        QUEUED_TOKENS_STAT: float(queued_tokens),
    }


@dataclass(frozen=True)
class Load:
    """What the replicas report, summed over the running replicas."""

    waiting: float  # requests waiting on replicas + requests queued in Serve's handles
    kv_usage: float  # sum of the replicas' KV-cache usage fractions
    queued_tokens: float = 0.0  # sum of the replicas' waiting prompt tokens


@dataclass(frozen=True)
class ScalingTargets:
    target_waiting_requests: float
    target_kv_cache_usage: float
    upscale_delay_s: float
    downscale_delay_s: float
    downscale_fraction: float = 0.7
    target_queued_tokens: float | None = None  # waiting prompt tokens per replica; None: off

    def __post_init__(self) -> None:
        if not self.target_waiting_requests > 0:
            raise ValueError("target_waiting_requests must be > 0")
        if not 0 < self.target_kv_cache_usage <= 1:
            raise ValueError("target_kv_cache_usage must be in (0, 1]")
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0:
            raise ValueError("upscale_delay_s and downscale_delay_s must be >= 0")
        if not 0 < self.downscale_fraction <= 1:
            raise ValueError("downscale_fraction must be in (0, 1]")
        if self.target_queued_tokens is not None and not self.target_queued_tokens > 0:
            raise ValueError("target_queued_tokens must be > 0 or None")

    def replicas_for(self, load: Load, fraction: float = 1.0) -> int:
        """Fewest replicas that hold `load` at `fraction` of the targets (0 for no load)."""
        need = max(
            load.waiting / (self.target_waiting_requests * fraction),
            load.kv_usage / (self.target_kv_cache_usage * fraction),
            load.queued_tokens / (self.target_queued_tokens * fraction)
            if self.target_queued_tokens
            else 0.0,
        )
        # A tiny float excess (3.0000000001) must not cost a replica.
        return max(0, math.ceil(need - 1e-9))


def desired_replicas(
    targets: ScalingTargets,
    load: Load,
    current: int,
    running: int,
    lo: int,
    hi: int,
    now: float,
    state: dict[str, Any],
) -> tuple[int, dict[str, Any]]:
    """The replica count to run now, and the policy state to keep for the next call.

    `current` is Serve's present target, `running` the replicas up; `lo`..`hi` the bounds.
    Pure: no Ray, no clock."""
    up = targets.replicas_for(load)
    if up > current:
        want = up
    elif running < current:
        want = current  # some still starting: wait for their load before going down
    else:
        # Fewer only when the load stays under the lower band on the smaller count.
        down = targets.replicas_for(load, targets.downscale_fraction)
        want = down if down < current else current
    want = min(max(want, lo), hi)
    state = dict(state)
    if want == current:
        state.pop(_WANT, None)
        state.pop(_SINCE, None)
        return current, state
    going_up = want > current
    prev = state.get(_WANT)
    # The clock runs while the wish keeps its direction; its size may change meanwhile.
    if prev is None or (prev > current) != going_up:
        state[_SINCE] = now
    state[_WANT] = want
    delay = targets.upscale_delay_s if going_up else targets.downscale_delay_s
    if now - state[_SINCE] + 1e-6 >= delay:
        state.pop(_WANT, None)
        state.pop(_SINCE, None)
        return want, state
    return current, state


def load_from_stats(per_replica: dict[str, dict[Any, float]] | None, queued: float) -> Load:
    """Load from Serve's aggregated custom metrics ({stat: {replica: value}}) and the
    requests queued in handles. A replica that has not reported yet counts as idle."""
    stats = per_replica or {}
    waiting = sum(stats.get(WAITING_STAT, {}).values())
    kv = sum(stats.get(KV_USAGE_STAT, {}).values())
    tokens = sum(stats.get(QUEUED_TOKENS_STAT, {}).values())
    return Load(waiting=waiting + max(0.0, queued), kv_usage=kv, queued_tokens=tokens)


class LLMAutoscalingPolicy:
    """Serve's class-callable policy: built once with `policy_kwargs`, called every tick
    with an AutoscalingContext; returns (replicas, policy_state)."""

    def __init__(self, **kwargs: Any) -> None:
        self.targets = ScalingTargets(**kwargs)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        load = load_from_stats(ctx.aggregated_metrics, ctx.total_queued_requests or 0.0)
        return desired_replicas(
            self.targets,
            load,
            current=ctx.target_num_replicas,
            running=ctx.current_num_replicas,
            lo=ctx.capacity_adjusted_min_replicas,
            hi=ctx.capacity_adjusted_max_replicas,
            now=ctx.current_time,
            state=ctx.policy_state,
        )

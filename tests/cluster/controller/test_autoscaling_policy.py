"""LLMAutoscalingPolicy without Ray running: Serve's real AutoscalingContext, fed the stats
replicas report, and the policy's decisions over a fake timeline (ctx.current_time)."""

from __future__ import annotations

from typing import Any

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from cluster.config import ServeConfig
from cluster.controller.autoscaling import (
    KV_USAGE_STAT,
    QUEUED_TOKENS_STAT,
    WAITING_STAT,
    LLMAutoscalingPolicy,
    Load,
    ScalingTargets,
    load_from_stats,
    scaling_stats,
)

DEP = DeploymentID(name="LLMServer", app_name="kvray")
TARGETS = {
    "target_waiting_requests": 4.0,
    "target_kv_cache_usage": 0.8,
    "upscale_delay_s": 10.0,
    "downscale_delay_s": 60.0,
}


class Sim:
    """One deployment under the policy: Serve's target follows each decision, as Serve's
    controller does once the policy returns."""

    def __init__(self, replicas: int, lo: int = 1, hi: int = 8, **targets: Any) -> None:
        self.policy = LLMAutoscalingPolicy(**{**TARGETS, **targets})
        self.replicas, self.lo, self.hi = replicas, lo, hi
        self.state: dict[str, Any] = {}

    def tick(
        self,
        now: float,
        waiting: list[float],
        kv: list[float],
        queued: float = 0,
        starting: int = 0,
    ) -> int:
        """One decision; the replicas up are those that report (`starting` more are not)."""
        ids = [ReplicaID(unique_id=f"r{i}", deployment_id=DEP) for i in range(len(waiting))]
        ctx = AutoscalingContext(
            deployment_id=DEP,
            deployment_name=DEP.name,
            app_name=DEP.app_name,
            current_num_replicas=len(ids) - starting,
            target_num_replicas=self.replicas,
            running_replicas=ids,
            total_num_requests=sum(waiting) + queued,
            total_queued_requests=queued,
            aggregated_metrics={
                WAITING_STAT: dict(zip(ids, waiting, strict=True)),
                KV_USAGE_STAT: dict(zip(ids, kv, strict=True)),
            },
            raw_metrics=None,
            capacity_adjusted_min_replicas=self.lo,
            capacity_adjusted_max_replicas=self.hi,
            policy_state=dict(self.state),
            last_scale_up_time=None,
            last_scale_down_time=None,
            current_time=now,
            config=None,
        )
        self.replicas, self.state = self.policy(ctx)
        return self.replicas


def test_burst_scales_up_after_the_upscale_delay() -> None:
    sim = Sim(replicas=1)
    # 13 waiting on one replica: 4 replicas hold them at 4 each (13 / 4 -> 4).
    assert sim.tick(0.0, [13], [0.3]) == 1
    assert sim.tick(5.0, [13], [0.3]) == 1
    assert sim.tick(10.0, [13], [0.3]) == 4


def test_kv_cache_usage_alone_scales_up() -> None:
    sim = Sim(replicas=2, upscale_delay_s=0.0)
    # No queue, but both caches at 95%: 1.9 of cache in use needs 3 replicas at 80%.
    assert sim.tick(0.0, [0, 0], [0.95, 0.95]) == 3


def test_scale_up_is_capped_by_max_replicas() -> None:
    sim = Sim(replicas=1, hi=3, upscale_delay_s=0.0)
    assert sim.tick(0.0, [100], [1.0]) == 3


def test_idle_scales_down_only_after_the_downscale_delay() -> None:
    sim = Sim(replicas=4)
    assert sim.tick(0.0, [0, 0, 0, 0], [0, 0, 0, 0]) == 4
    assert sim.tick(59.0, [0, 0, 0, 0], [0, 0, 0, 0]) == 4
    assert sim.tick(60.0, [0, 0, 0, 0], [0, 0, 0, 0]) == 1  # min_replicas


def test_scales_to_zero_when_min_replicas_is_zero() -> None:
    sim = Sim(replicas=2, lo=0)
    assert sim.tick(0.0, [0, 0], [0, 0]) == 2
    assert sim.tick(60.0, [0, 0], [0, 0]) == 0


def test_no_downscale_while_replicas_start() -> None:
    # A fresh deployment (min 0): its first replica loads and reports nothing yet.
    sim = Sim(replicas=1, lo=0, downscale_delay_s=0.0)
    assert sim.tick(0.0, [], []) == 1  # no replica up yet
    assert sim.tick(5.0, [0], [0], starting=1) == 1  # listed, still starting
    assert sim.tick(6.0, [0], [0]) == 0  # up, and idle: down


def test_not_to_zero_while_requests_wait_in_handles() -> None:
    # Requests Serve's handles hold (no replica took them yet) are load too.
    sim = Sim(replicas=1, lo=0, downscale_delay_s=0.0)
    assert sim.tick(0.0, [0], [0], queued=2) == 1


def test_a_load_spike_restarts_the_downscale_clock() -> None:
    sim = Sim(replicas=3)
    assert sim.tick(0.0, [0, 0, 0], [0, 0, 0]) == 3
    # Busy again in between (exactly at target: no change wanted): the wish is dropped.
    assert sim.tick(30.0, [4, 4, 4], [0.5, 0.5, 0.5]) == 3
    assert sim.tick(31.0, [0, 0, 0], [0, 0, 0]) == 3
    assert sim.tick(89.0, [0, 0, 0], [0, 0, 0]) == 3  # 58 s after the clock restarted
    assert sim.tick(91.0, [0, 0, 0], [0, 0, 0]) == 1


def test_hysteresis_band_holds_a_load_just_under_target() -> None:
    # 2 replicas at 7 waiting in all: 1 replica would be at 7 > 4, 2 are at 3.5 < 4. The
    # band keeps 2 (7 / (4 * 0.7) = 2.5 -> 3 >= 2) instead of flapping 2 -> 1 -> 2.
    sim = Sim(replicas=2, upscale_delay_s=0.0, downscale_delay_s=0.0)
    for t in range(5):
        assert sim.tick(float(t), [3.5, 3.5], [0.2, 0.2]) == 2
    # Well under the band on one replica (2 / 2.8 -> 1): down.
    assert sim.tick(10.0, [1, 1], [0.1, 0.1]) == 1


def test_flapping_load_never_changes_the_count() -> None:
    # The load swings above and below the band faster than either delay: no change ever.
    sim = Sim(replicas=2)
    for t in range(40):
        busy = t % 2 == 0
        w = [9.0, 9.0] if busy else [0.0, 0.0]
        assert sim.tick(float(t), w, [0.3, 0.3]) == 2


def test_replicas_for_rounds_and_takes_the_larger_signal() -> None:
    t = ScalingTargets(**TARGETS)
    assert t.replicas_for(Load(waiting=0, kv_usage=0)) == 0
    assert t.replicas_for(Load(waiting=8, kv_usage=0.1)) == 2
    assert t.replicas_for(Load(waiting=8.4, kv_usage=0.1)) == 3
    assert t.replicas_for(Load(waiting=1, kv_usage=2.4)) == 3  # 2.4 / 0.8 = 3 exactly


def test_prefill_replicas_scale_on_their_waiting_prompt_tokens() -> None:
    """A third signal, for prefill replicas: the prompt tokens waiting on them."""
    t = ScalingTargets(**TARGETS, target_queued_tokens=4096.0)
    assert t.replicas_for(Load(waiting=1, kv_usage=0.1, queued_tokens=10000)) == 3
    # Off (the decode replicas): the tokens say nothing.
    assert ScalingTargets(**TARGETS).replicas_for(Load(1, 0.1, queued_tokens=10**6)) == 1
    load = load_from_stats(
        {QUEUED_TOKENS_STAT: {"r0": 3000.0, "r1": 5000.0}, WAITING_STAT: {"r0": 1.0}}, 0
    )
    assert load == Load(waiting=1.0, kv_usage=0.0, queued_tokens=8000.0)
    assert scaling_stats(2, 0.5, 300) == {
        WAITING_STAT: 2.0,
        KV_USAGE_STAT: 0.5,
        QUEUED_TOKENS_STAT: 300.0,
    }


@pytest.mark.parametrize(
    "bad",
    [
        {"target_queued_tokens": 0.0},
        {"target_waiting_requests": 0.0},
        {"target_kv_cache_usage": 1.5},
        {"downscale_delay_s": -1.0},
    ],
)
def test_bad_targets_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        ScalingTargets(**{**TARGETS, **bad})


def test_serve_config_hands_the_policy_to_serve() -> None:
    """The autoscaling_config ServeConfig builds is one Serve accepts, and names this policy
    with the config's targets; Serve's own delays are 0 (the policy applies them)."""
    from ray.serve._private.autoscaling_state import _resolve_policy_callable

    cfg = ServeConfig.from_flat(
        min_replicas=0, max_replicas=3, target_waiting_requests=2.0, downscale_delay_s=30.0
    )
    serve_cfg = AutoscalingConfig(**cfg.autoscaling_config())
    assert (serve_cfg.min_replicas, serve_cfg.max_replicas, serve_cfg.initial_replicas) == (
        0,
        3,
        1,
    )
    assert serve_cfg.upscale_delay_s == serve_cfg.downscale_delay_s == 0
    policy = _resolve_policy_callable(serve_cfg.policy)
    assert isinstance(policy, LLMAutoscalingPolicy)
    assert policy.targets == ScalingTargets(
        target_waiting_requests=2.0,
        target_kv_cache_usage=0.8,
        upscale_delay_s=10.0,
        downscale_delay_s=30.0,
    )


def test_ongoing_requests_policy_is_serves_default() -> None:
    cfg = ServeConfig.from_flat(
        max_replicas=2, autoscaling_policy="ongoing_requests", upscale_delay_s=3.0
    )
    serve_cfg = AutoscalingConfig(**cfg.autoscaling_config())
    assert serve_cfg.policy.is_default_policy_function()
    assert serve_cfg.upscale_delay_s == 3.0


@pytest.mark.parametrize(
    "field, value",
    [
        ("autoscaling_policy", "queue"),
        ("target_waiting_requests", 0),
        ("target_kv_cache_usage", 0.0),
        ("upscale_delay_s", -1),
        ("downscale_delay_s", float("nan")),
    ],
)
def test_bad_autoscaling_fields_name_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"^{field} "):
        ServeConfig.from_flat(**{field: value})

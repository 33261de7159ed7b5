"""The autoscaling section and the autoscaling_config Serve gets from it."""

from __future__ import annotations

import pytest

from cluster.config import ServeConfig
from cluster.config.autoscaling import AUTOSCALING_LOOK_BACK_S, AutoscalingSettings


def test_autoscaling_config() -> None:
    assert ServeConfig.from_flat(num_replicas=4).autoscaling_config() is None
    auto = ServeConfig.from_flat(
        min_replicas=1,
        max_replicas=4,
        target_ongoing_requests=8,
        autoscaling_policy="ongoing_requests",
        upscale_delay_s=5.0,
    )
    assert auto.autoscaling.enabled
    assert auto.autoscaling_config() == {
        "min_replicas": 1,
        "max_replicas": 4,
        "initial_replicas": 1,
        "target_ongoing_requests": 8,
        "look_back_period_s": AUTOSCALING_LOOK_BACK_S,
        "upscale_delay_s": 5.0,
        "downscale_delay_s": 120.0,
    }
    # The default, LLM-signal policy: tests/cluster/controller/test_autoscaling_policy.py.
    assert "policy" in ServeConfig.from_flat(max_replicas=2).autoscaling_config()
    only_max = ServeConfig.from_flat(max_replicas=3).autoscaling_config()
    assert only_max["min_replicas"] == 1 and only_max["max_replicas"] == 3


def test_the_section_checks_its_bounds() -> None:
    with pytest.raises(ValueError, match=r"^max_replicas must be >= min_replicas, got 2"):
        AutoscalingSettings(min_replicas=3, max_replicas=2)
    assert not AutoscalingSettings().enabled and AutoscalingSettings(min_replicas=0).enabled

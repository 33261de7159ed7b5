"""ServeConfig's autoscaling: the `autoscaling_config` Ray Serve gets for LLMServer
(cluster/config.py's `ServeConfig.autoscaling_config` calls `autoscaling_config` here)."""

from __future__ import annotations

from typing import Any

# The policy class of autoscaling_policy "llm", as Serve imports it.
LLM_AUTOSCALING_POLICY = "cluster.controller.autoscaling:LLMAutoscalingPolicy"
# The window Serve averages each replica's stats over: short, so the policy sees the load of
# now (the policy's delays, not a long average, keep it from flapping), yet over Serve's
# deprecated metrics_interval_s (10 s), which it warns about otherwise.
AUTOSCALING_LOOK_BACK_S = 11.0


def autoscaling_config(cfg: Any) -> dict[str, Any] | None:
    """Ray Serve's autoscaling_config for LLMServer, or None for a fixed replica count."""
    if cfg.min_replicas is None and cfg.max_replicas is None:
        return None
    lo = cfg.min_replicas if cfg.min_replicas is not None else 1
    hi = cfg.max_replicas if cfg.max_replicas is not None else max(lo, cfg.num_replicas)
    config: dict[str, Any] = {
        "min_replicas": lo,
        "max_replicas": hi,
        "initial_replicas": max(lo, 1),
        "target_ongoing_requests": cfg.target_ongoing_requests,
        "look_back_period_s": AUTOSCALING_LOOK_BACK_S,
        "upscale_delay_s": cfg.upscale_delay_s,
        "downscale_delay_s": cfg.downscale_delay_s,
    }
    if cfg.autoscaling_policy == "llm":
        # The policy applies the delays itself (with its hysteresis band): Serve's are 0.
        kwargs = {
            "target_waiting_requests": float(cfg.target_waiting_requests),
            "target_kv_cache_usage": float(cfg.target_kv_cache_usage),
            "upscale_delay_s": float(cfg.upscale_delay_s),
            "downscale_delay_s": float(cfg.downscale_delay_s),
        }
        config |= {
            "upscale_delay_s": 0.0,
            "downscale_delay_s": 0.0,
            "policy": {"policy_function": LLM_AUTOSCALING_POLICY, "policy_kwargs": kwargs},
        }
    return config

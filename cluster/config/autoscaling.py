"""The autoscaling section: replica bounds and the signal that moves between them, and the
`autoscaling_config` Ray Serve gets for LLMServer from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cluster.config.checks import is_int, is_num, need, need_choice, need_positive_ints
from cluster.config.setting import REPLICAS_GROUP, setting

# The policy class of autoscaling_policy "llm", as Serve imports it.
LLM_AUTOSCALING_POLICY = "cluster.controller.autoscaling:LLMAutoscalingPolicy"
# The window Serve averages each replica's stats over: short, so the policy sees the load of
# now (the policy's delays, not a long average, keep it from flapping), yet over Serve's
# deprecated metrics_interval_s (10 s), which it warns about otherwise.
AUTOSCALING_LOOK_BACK_S = 11.0
# llm: waiting requests + KV-cache usage per replica (cluster/controller/autoscaling.py);
# ongoing_requests: Ray Serve's default policy (--target-ongoing-requests).
AUTOSCALING_POLICIES = ("llm", "ongoing_requests")


@dataclass(frozen=True)
class AutoscalingSettings:
    """Autoscaling of the engine replicas: on when either bound is set."""

    min_replicas: int | None = setting(
        None, "autoscaling lower bound (enables autoscaling)", REPLICAS_GROUP
    )
    max_replicas: int | None = setting(
        None, "autoscaling upper bound (enables autoscaling)", REPLICAS_GROUP
    )
    target_ongoing_requests: int = setting(
        16, "autoscaling target per replica (--autoscaling-policy ongoing_requests)", REPLICAS_GROUP
    )
    autoscaling_policy: str = setting(
        "llm",
        "autoscaling signal: waiting requests and KV-cache usage per replica, or Serve's "
        "ongoing requests",
        REPLICAS_GROUP,
        choices=AUTOSCALING_POLICIES,
    )
    target_waiting_requests: float = setting(
        4.0, "autoscaling: waiting (admitted, not running) requests per replica", REPLICAS_GROUP
    )
    target_kv_cache_usage: float = setting(
        0.8, "autoscaling: fraction of each replica's KV cache in use, in (0, 1]", REPLICAS_GROUP
    )
    upscale_delay_s: float = setting(
        10.0, "autoscaling: seconds the load must ask for more replicas first", REPLICAS_GROUP
    )
    downscale_delay_s: float = setting(
        120.0,
        "autoscaling: seconds the load must allow fewer replicas first (to zero too, with "
        "--min-replicas 0: the next request then waits for a replica to start)",
        REPLICAS_GROUP,
    )

    def __post_init__(self) -> None:
        need_positive_ints(self, "target_ongoing_requests")
        lo, hi = self.min_replicas, self.max_replicas
        need(
            lo is None or (is_int(lo) and lo >= 0),
            "min_replicas",
            "must be an integer >= 0 or null",
            lo,
        )
        need(
            hi is None or (is_int(hi) and hi >= 1),
            "max_replicas",
            "must be an integer >= 1 or null",
            hi,
        )
        if lo is not None and hi is not None:
            need(hi >= lo, "max_replicas", "must be >= min_replicas", hi)
        need_choice(self, "autoscaling_policy", AUTOSCALING_POLICIES)
        w = self.target_waiting_requests
        need(is_num(w) and w > 0, "target_waiting_requests", "must be a number > 0", w)
        u = self.target_kv_cache_usage
        need(is_num(u) and 0 < u <= 1, "target_kv_cache_usage", "must be a number in (0, 1]", u)
        for name in ("upscale_delay_s", "downscale_delay_s"):
            v = getattr(self, name)
            need(is_num(v) and v >= 0, name, "must be a number >= 0", v)

    @property
    def enabled(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    def serve_config(
        self, num_replicas: int, extra_policy_kwargs: dict[str, float] | None = None
    ) -> dict[str, Any] | None:
        """Ray Serve's autoscaling_config for LLMServer, or None for a fixed replica count
        (`num_replicas`, which also widens an upper bound left unset). `extra_policy_kwargs`:
        more of the llm policy's targets (the prefill replicas' waiting prompt tokens)."""
        if not self.enabled:
            return None
        lo = self.min_replicas if self.min_replicas is not None else 1
        hi = self.max_replicas if self.max_replicas is not None else max(lo, num_replicas)
        config: dict[str, Any] = {
            "min_replicas": lo,
            "max_replicas": hi,
            "initial_replicas": max(lo, 1),
            "target_ongoing_requests": self.target_ongoing_requests,
            "look_back_period_s": AUTOSCALING_LOOK_BACK_S,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
        }
        if self.autoscaling_policy == "llm":
            # The policy applies the delays itself (with its hysteresis band): Serve's are 0.
            kwargs = {
                "target_waiting_requests": float(self.target_waiting_requests),
                "target_kv_cache_usage": float(self.target_kv_cache_usage),
                "upscale_delay_s": float(self.upscale_delay_s),
                "downscale_delay_s": float(self.downscale_delay_s),
                **(extra_policy_kwargs or {}),
            }
            config |= {
                "upscale_delay_s": 0.0,
                "downscale_delay_s": 0.0,
                "policy": {"policy_function": LLM_AUTOSCALING_POLICY, "policy_kwargs": kwargs},
            }
        return config

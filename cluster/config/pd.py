"""The disaggregation section: replicas that only prefill, and which requests use them.

With `prefill_replicas` > 0 the application has a second engine deployment
(LLMServerPrefill). A request the policy sends there has its prompt's KV computed and its
first token sampled on a prefill replica, which publishes the prompt's blocks to the cluster
KV tier; a decode replica (the `num_replicas` ones: LLMServer) pulls them and generates the
rest (cluster/ingress/pd.py). The KV moves through the tier, so it needs `kv_share_gib` > 0
(ServeConfig checks that).

The prefill replicas are a fixed count unless `prefill_max_replicas` is set: then they
autoscale from `prefill_replicas` to it on the prompt tokens waiting on them, their work
(cluster/controller/autoscaling.py), with the decode replicas' delays and request target."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cluster.config.checks import is_int, is_num, need, need_choice
from cluster.config.setting import REPLICAS_GROUP, setting

if TYPE_CHECKING:
    from cluster.config.autoscaling import AutoscalingSettings

PD_MODES = ("auto", "always", "off")


@dataclass(frozen=True)
class PdSettings:
    """Prefill/decode disaggregation: replicas that only prefill, and which requests use them."""

    prefill_replicas: int = setting(
        0,
        "engine replicas that only prefill: a disaggregated request's prompt KV and first "
        "token are computed there, and a decode replica (--decode-replicas) pulls the KV "
        "through the cluster KV tier and generates the rest; needs --kv-share-gib; 0: none",
        REPLICAS_GROUP,
    )
    pd: str = setting(
        "auto",
        "with prefill replicas, which requests go to one first: always, off, or auto (each "
        "by an estimate of the delay it adds either way, from the replicas' load, cached "
        "prefixes and measured rates)",
        REPLICAS_GROUP,
        choices=PD_MODES,
    )
    prefill_max_replicas: int | None = setting(
        None,
        "autoscale the prefill replicas from --prefill-replicas up to this many, on the "
        "prompt tokens waiting on them; unset: a fixed count",
        REPLICAS_GROUP,
    )
    target_prefill_queued_tokens: float = setting(
        8192.0,
        "prefill autoscaling: prompt tokens waiting per prefill replica",
        REPLICAS_GROUP,
    )

    def __post_init__(self) -> None:
        p = self.prefill_replicas
        need(is_int(p) and p >= 0, "prefill_replicas", "must be an integer >= 0", p)
        need_choice(self, "pd", PD_MODES)
        hi = self.prefill_max_replicas
        need(
            hi is None or (is_int(hi) and hi >= max(p, 1)),
            "prefill_max_replicas",
            f"must be an integer >= prefill_replicas ({p}) and >= 1, or null",
            hi,
        )
        t = self.target_prefill_queued_tokens
        need(is_num(t) and t > 0, "target_prefill_queued_tokens", "must be a number > 0", t)

    def serve_autoscaling(self, decode: AutoscalingSettings) -> dict[str, Any] | None:
        """Ray Serve's autoscaling_config of the prefill deployment (None: a fixed count):
        the llm policy with `decode`'s delays and waiting-request target, KV usage at most
        one replica's worth, and the waiting prompt tokens as a third signal."""
        if self.prefill_max_replicas is None:
            return None
        from dataclasses import replace

        prefill = replace(
            decode,
            min_replicas=self.prefill_replicas,
            max_replicas=self.prefill_max_replicas,
            autoscaling_policy="llm",
            target_kv_cache_usage=1.0,
        )
        tokens = {"target_queued_tokens": float(self.target_prefill_queued_tokens)}
        return prefill.serve_config(self.prefill_replicas, tokens)

    @property
    def enabled(self) -> bool:
        """Whether the application disaggregates any request."""
        return self.prefill_replicas > 0 and self.pd != "off"

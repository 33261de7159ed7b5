"""The disaggregation section: replicas that only prefill, and which requests use them.

With `prefill_replicas` > 0 the application has a second engine deployment
(LLMServerPrefill). A request the policy sends there has its prompt's KV computed and its
first token sampled on a prefill replica, which publishes the prompt's blocks to the cluster
KV tier; a decode replica (the `num_replicas` ones: LLMServer) pulls them and generates the
rest (cluster/ingress/pd.py). The KV moves through the tier, so it needs `kv_share_gib` > 0
(ServeConfig checks that)."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.config.checks import is_int, need, need_choice
from cluster.config.setting import REPLICAS_GROUP, setting

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
        "with prefill replicas, which requests go to one first: always, off, or auto (those "
        "whose prompt is longer than one engine step's token budget, which would otherwise "
        "hold up the decode replica's streams for several steps)",
        REPLICAS_GROUP,
        choices=PD_MODES,
    )

    def __post_init__(self) -> None:
        p = self.prefill_replicas
        need(is_int(p) and p >= 0, "prefill_replicas", "must be an integer >= 0", p)
        need_choice(self, "pd", PD_MODES)

    @property
    def enabled(self) -> bool:
        """Whether the application disaggregates any request."""
        return self.prefill_replicas > 0 and self.pd != "off"

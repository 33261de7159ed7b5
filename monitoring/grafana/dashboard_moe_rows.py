"""The dashboard's row about mixture-of-experts models: which experts are hot.

The `expert` label has one value per expert index (the metric sums the MoE layers), so a
model of 128 experts draws 128 lines: the panel shows the busiest ones. Dense models export
neither metric, and the row stays empty.
"""

from __future__ import annotations

from dashboard_panels import M, Panel, Row, Target, rate

MOE_ROWS: tuple[Row, ...] = (
    Row(
        "Mixture of experts",
        (
            Panel(
                "Tokens per expert (busiest 10)",
                "Tokens routed per second to each expert index, summed over the MoE layers "
                "and the replicas. With --enable-expert-parallel a rank holds the same expert "
                "indices in every layer, so uneven lines are uneven ranks.",
                (
                    Target(
                        f"topk(10, {rate('ray_kvray_moe_expert_tokens_total', M, by='expert')})",
                        "expert {{expert}}",
                    ),
                ),
                width=12,
            ),
            Panel(
                "Expert load imbalance",
                "Each replica's busiest expert's tokens over the mean per expert (per layer, "
                "averaged over the layers): 1 is balanced; top_k / num_experts of the tokens "
                "on one expert is the worst.",
                (
                    Target(
                        f"max by (replica) (ray_kvray_moe_expert_load_imbalance_ratio{{{M}}})",
                        "{{replica}}",
                    ),
                ),
                width=12,
                min=0,
            ),
        ),
    ),
)

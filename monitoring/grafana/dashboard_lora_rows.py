"""The dashboard's row about LoRA adapters: traffic and latency per adapter, the engines'
adapter slots, loads and evictions, and how the routers placed adapter requests.

The `lora` label's values are bounded by each replica (its first 16 adapter names, then
"other"), so grouping by it stays cheap. Base-model requests carry `lora=""`; the queries
rename it "base model" so the base model shows next to its adapters.
"""

from __future__ import annotations

from dashboard_panels import MR, RI, M, Panel, Row, Target, quantiles, rate

SLOTS_USED = f"ray_kvray_lora_slots_used{{{MR}}}"
SLOTS = f"ray_kvray_lora_slots{{{MR}}}"


def _base_named(expr: str) -> str:
    # label_replace's regex is anchored: "" matches only the empty value (base-model requests).
    return f'label_replace({expr}, "lora", "base model", "lora", "")'


LORA_ROWS: tuple[Row, ...] = (
    Row(
        "LoRA adapters",
        (
            Panel(
                "Requests by adapter",
                "Requests per second that ended on the engine replicas, by LoRA adapter (the "
                "`model` a request named), with the base model's next to them.",
                (
                    Target(
                        _base_named(rate("ray_kvray_lora_requests_total", M, by="lora")),
                        "{{lora}}",
                    ),
                ),
                unit="reqps",
            ),
            Panel(
                "Tokens by adapter",
                "Prompt and generated tokens per second of finished requests, by adapter.",
                (
                    Target(
                        _base_named(rate("ray_kvray_lora_prompt_tokens_total", M, by="lora")),
                        "{{lora}} prompt",
                    ),
                    Target(
                        _base_named(rate("ray_kvray_lora_generation_tokens_total", M, by="lora")),
                        "{{lora}} output",
                    ),
                ),
            ),
            Panel(
                "TTFT by adapter",
                "Median and 99th percentile time to first token by adapter: an adapter that "
                "has to be loaded first, or that waits for a free slot, starts later.",
                tuple(
                    Target(_base_named(t.expr), t.legend)
                    for t in quantiles(
                        "ray_kvray_lora_time_to_first_token_seconds", M, (0.5, 0.99), by="lora"
                    )
                ),
                unit="s",
            ),
            Panel(
                "Adapter slots",
                "Each replica's device slots holding an adapter, against its slots "
                "(--max-loras). Full slots with many adapters in use mean loads and evictions.",
                (
                    Target(f"max by (replica) ({SLOTS_USED})", "{{replica}} used"),
                    Target(f"max by (replica) ({SLOTS})", "{{replica}} slots"),
                ),
                width=6,
                min=0,
            ),
            Panel(
                "Adapter loads and evictions",
                "Adapters loaded into a device slot per second, and loads that evicted "
                "another adapter. Evictions close to loads: more adapters are in use than "
                "slots (raise --max-loras, or add replicas).",
                (
                    Target(rate("ray_kvray_lora_loads_total", MR), "loads"),
                    Target(rate("ray_kvray_lora_evictions_total", MR), "evictions"),
                ),
                unit="ops",
                width=6,
            ),
            Panel(
                "Adapter load time",
                "Mean seconds to load one adapter into a slot (from the host cache or the "
                "disk), and the seconds per second the engines spent loading; 0 while none "
                "was loaded.",
                (
                    Target(
                        f"sum(rate(ray_kvray_lora_load_seconds_total{{{MR}}}[{RI}])) / "
                        f"clamp_min(sum(rate(ray_kvray_lora_loads_total{{{MR}}}[{RI}])), 1e-9)",
                        "mean per load",
                    ),
                    Target(rate("ray_kvray_lora_load_seconds_total", MR), "loading, s/s"),
                ),
                unit="s",
                width=6,
            ),
            Panel(
                "Adapter routing",
                "How the routers placed LoRA requests per second: held (to a replica holding "
                "the adapter), cold (no replica held it), spread (its holders were saturated, "
                "so another replica loads it too).",
                (
                    Target(
                        rate("ray_kvray_router_lora_routing_total", by="decision"),
                        "{{decision}}",
                    ),
                ),
                unit="reqps",
                width=6,
            ),
        ),
    ),
)

"""The tenant label's values stay bounded: named tenants and "default" always, the first header
tenants seen, the rest "other". (The metrics themselves, scraped from a real deployment, are in
test_tenants_live.py.)"""

from __future__ import annotations

from cluster.ingress.tenant_metrics import MAX_HEADER_TENANTS, TenantLabels


def test_named_tenants_keep_their_label_and_header_tenants_are_bounded() -> None:
    label = TenantLabels(["acme", "beta"], max_others=2)
    assert label("acme") == "acme" and label("default") == "default"
    assert label("h1") == "h1" and label("h2") == "h2"
    assert label("h3") == "other" and label("h4") == "other"
    assert label("h1") == "h1"  # a labelled one keeps its label
    assert label("beta") == "beta"  # named ones never count against the bound


def test_the_default_bound() -> None:
    label = TenantLabels([])
    values = {label(f"t{i}") for i in range(MAX_HEADER_TENANTS + 10)}
    assert len(values) == MAX_HEADER_TENANTS + 1 and "other" in values

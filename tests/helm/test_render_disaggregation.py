"""The chart's KV values (the tiers, the cache's dtype) and disaggregation values in the Serve
config it renders, and the rules across them that fail the render."""

from __future__ import annotations

import pytest

from tests.helm.helpers import only, serve_config

ON = {
    "engine": {"kvOffloadGib": 2, "kvShareGib": 1},
    "serve": {"disaggregation": {"prefillReplicas": 2, "mode": "always"}},
}


def _args(render, values) -> dict:
    return serve_config(only(render(values), "RayService"))["applications"][0]["args"]


def test_the_tiers_and_prefill_replicas_reach_the_app_only_when_set(render):
    from cluster.config import ServeConfig

    args = _args(render, None)
    assert not {"kv_offload_gib", "kv_share_gib", "prefill_replicas", "pd"} & set(args)
    config = ServeConfig.from_args(_args(render, ON))
    assert (config.engine.kv_offload_gib, config.engine.kv_share_gib) == (2, 1)
    assert (config.pd.prefill_replicas, config.pd.pd) == (2, "always")
    # Autoscaled prefill replicas, and the worker group's bounds that make room for them.
    auto = {**ON, "serve": {"disaggregation": {"prefillReplicas": 1, "prefillMaxReplicas": 3}}}
    config = ServeConfig.from_args(_args(render, auto))
    assert (config.pd.prefill_replicas, config.pd.prefill_max_replicas) == (1, 3)
    assert config.pd.target_prefill_queued_tokens == 8192
    rayservice = only(render(auto), "RayService")
    (group,) = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert (group["minReplicas"], group["maxReplicas"]) == (1 + 1, 2 + 3)  # decode 1..2
    # The tiers alone: no prefill deployment.
    tiers = {"engine": ON["engine"]}
    config = ServeConfig.from_args(_args(render, tiers))
    assert config.pd.prefill_replicas == 0 and config.engine.kv_share_gib == 1


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (
            {"serve": {"disaggregation": {"prefillReplicas": 1}}},
            "serve.disaggregation.prefillReplicas needs engine.kvShareGib > 0",
        ),
        ({"engine": {"kvShareGib": 1}}, "engine.kvShareGib needs engine.kvOffloadGib > 0"),
        (
            {**ON, "serve": {"disaggregation": {"prefillReplicas": 2, "prefillMaxReplicas": 1}}},
            "serve.disaggregation.prefillMaxReplicas (1) must be >= "
            "serve.disaggregation.prefillReplicas (2)",
        ),
    ],
)
def test_prefill_replicas_without_the_cluster_tier_fail_the_render(render, values, expected):
    import helm_python

    with pytest.raises(helm_python.HelmError) as info:
        render(values)
    assert expected in str(info.value)


def test_the_schema_names_a_bad_mode(render):
    import helm_python

    with pytest.raises(helm_python.HelmError) as info:
        render({"serve": {"disaggregation": {"prefillReplicas": 1, "mode": "sometimes"}}})
    assert "/serve/disaggregation/mode" in str(info.value)


def test_an_fp8_kv_cache_reaches_the_app_only_when_set(render) -> None:
    from cluster.config import ServeConfig

    assert "kv_cache_dtype" not in _args(render, None)
    config = ServeConfig.from_args(_args(render, {"engine": {"kvCacheDtype": "fp8"}}))
    assert config.engine.kv_cache_dtype == "fp8"

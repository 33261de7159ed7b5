"""ServeConfig: validation at the edge, YAML args round trip, engine kwargs."""

from __future__ import annotations

import pytest

from cluster.config import ServeConfig, resolve_tokenizer
from cluster.config.setting import Setting
from workers.config import DEFAULT_BLOCK_SIZE


def test_defaults_match_the_contract() -> None:
    c = ServeConfig()
    assert (
        c.replicas.num_replicas,
        c.engine.tensor_parallel_size,
        c.limits.max_queued_requests,
    ) == (1, 1, 128)
    assert (
        c.autoscaling.target_ongoing_requests,
        c.replicas.max_ongoing_requests,
        c.engine.max_num_seqs,
    ) == (16, 256, 256)
    assert (
        c.network.api_key_env == "KVRAY_API_KEY"
        and c.engine.device == "auto"
        and c.engine.enable_prefix_caching
    )
    assert c.network.grpc_max_message_bytes == 4 * 1024 * 1024 and c.replicas.ingress_replicas == 1
    assert c.engine.model_name() == "kvray-demo" and not c.autoscaling.enabled
    assert c.replicas.engine_process  # TP = 1 engine cores run in a child process of the replica
    assert c.engine.block_size == DEFAULT_BLOCK_SIZE  # the engine's, not a copy


def test_engine_kwargs_are_engine_args() -> None:
    from workers.config import EngineArgs

    c = ServeConfig.from_flat(block_size=32, max_num_seqs=8, device="cpu", served_model_name="m")
    args = EngineArgs(**c.engine_kwargs("/ckpt"))
    assert (args.model, args.block_size, args.max_num_seqs) == ("/ckpt", 32, 8)
    assert args.device == "cpu" and args.served_model_name == "m"
    assert EngineArgs(**ServeConfig().engine_kwargs("/ckpt")).device is None  # auto: engine picks


def test_every_field_documents_its_flag() -> None:
    for _, f, flag in ServeConfig.settings():
        assert isinstance(flag, Setting) and flag.help and flag.group, f.name


def test_unknown_args_are_an_error_listing_valid_keys() -> None:
    with pytest.raises(ValueError, match=r"num_replica\b.*valid keys: .*num_replicas"):
        ServeConfig.from_args({"num_replica": 2})


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"num_replicas": 0}, "num_replicas"),
        ({"tensor_parallel_size": "2"}, "tensor_parallel_size"),
        ({"max_queued_requests": True}, "max_queued_requests"),
        ({"max_model_len": -5}, "max_model_len"),
        ({"min_replicas": 3, "max_replicas": 2}, "max_replicas"),
        ({"device": "tpu"}, "device"),
        ({"api_key_env": "not a var"}, "api_key_env"),
        ({"request_router": "random"}, "request_router"),
        ({"enable_prefix_caching": "yes"}, "enable_prefix_caching"),
        ({"engine_process": 1}, "engine_process"),
        ({"block_size": 0}, "block_size"),
        ({"num_cpus_per_replica": 0}, "num_cpus_per_replica"),
        ({"num_cpus_per_replica": "4"}, "num_cpus_per_replica"),
        ({"num_cpus_per_replica": True}, "num_cpus_per_replica"),
    ],
)
def test_bad_values_name_the_field(args: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field} "):
        ServeConfig.from_args(args)


def test_args_round_trip() -> None:
    c = ServeConfig.from_flat(model="/models/qwen", num_replicas=3, kv_cache_memory_bytes=1 << 30)
    args = c.to_args()
    assert "max_model_len" not in args  # None fields are left out
    assert ServeConfig.from_args(args) == c


def test_the_ingresses_read_the_tokenizer_named_else_the_model() -> None:
    gguf = ServeConfig.from_flat(model="/m/x.gguf")
    assert resolve_tokenizer(gguf) == "/m/x.gguf"  # the file's own tokenizer
    named = ServeConfig.from_flat(model="/m/x.gguf", tokenizer="/tok")
    assert resolve_tokenizer(named) == "/tok"
    assert named.engine_kwargs("/m/x.gguf")["tokenizer"] == "/tok"

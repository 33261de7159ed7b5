"""Prefill/decode disaggregation end to end: an application with one prefill and one decode
replica (`--prefill-replicas 1 --pd always`), each of TP 2, serves greedy and seeded requests,
streamed and not, over HTTP, and requests under a LoRA adapter and under a JSON-schema
grammar. Each must equal the offline engine's text with exact usage; the prefill replica must
have published the prompts' blocks and the decode replica pulled them (it never computed a
handed-off prompt); afterwards neither holds a KV block. With the prefill replica's engine
killed (a TP rank of it), requests fall back to the decode replica and are still exact.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from cluster.config import ServeConfig
from cluster.deploy.app import PREFILL_SERVER_NAME
from tests.cluster.migration_load import (
    LoadRequest,
    build_load,
    expected_texts,
    failures,
    kill_pid,
    start_load,
)
from tests.cluster.serve_helpers import (
    KV_CACHE_BYTES,
    App,
    ServePorts,
    deploy,
    openai_client,
    store_bytes_within,
    tier_bytes,
    wait_for,
    wait_until_idle,
)

pytestmark = pytest.mark.slow

# 6 full blocks of the demo's 16-token blocks, and some tokens past them.
PROMPT_LEN = 100
ADAPTER = "a"
# Object-store bytes that are not the tier's (Serve's and Ray's own small objects).
STORE_SLACK_BYTES = 1 << 20
# Bounded, so that an answer ends within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def adapter(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.workers.lora.adapters import write_random_adapter

    return str(write_random_adapter(demo_dir, tmp_path_factory.mktemp("pd") / "a", seed=1))


@dataclass(frozen=True)
class PdApp(App):
    store_before: int = 0  # the object store's bytes in use before the app
    share_bytes: int = 0  # its cluster KV tier's budget


@pytest.fixture(scope="module")
def app(serve_ports: ServePorts, adapter: str) -> Iterator[PdApp]:
    from ray import serve

    from cluster.ray_internals import object_store_stats
    from cluster.replica.kv_directory import delete_directory

    config = ServeConfig.from_flat(
        num_replicas=1,
        prefill_replicas=1,
        pd="always",
        # TP 2 both: every rank publishes and pulls its shard of each block.
        tensor_parallel_size=2,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        kv_offload_gib=0.05,
        kv_share_gib=0.1,
        lora_modules=[f"{ADAPTER}={adapter}"],
        max_lora_rank=16,
        api_key_env="KVRAY_PD_NO_KEY",  # unset on the cluster: no key required
    )
    before = object_store_stats()["bytes_used"]
    app = deploy("pd", "/pd", config, serve_ports, None)
    try:
        yield PdApp(*astuple(app), before, int(config.engine.kv_share_gib * (1 << 30)))
    finally:
        serve.delete(app.name)
        delete_directory(app.name)  # as `kvray serve` does when it stops
    # Every published block was freed with the application's tier.
    store_bytes_within(before + STORE_SLACK_BYTES)


def _load(seed: int, min_tokens: int = 16, max_tokens: int = 48) -> list[LoadRequest]:
    return build_load(
        seed, count=12, prompt_len=PROMPT_LEN, min_tokens=min_tokens, max_tokens=max_tokens,
        vias=("http_stream", "http"),
    )  # fmt: skip


def _prefill_stats(app: App) -> dict[str, Any]:
    return app.handle(PREFILL_SERVER_NAME).replica_stats.remote().result()


def _decode_stats(app: App) -> dict[str, Any]:
    return app.handle().replica_stats.remote().result()


def test_disaggregated_requests_equal_the_offline_engine(
    app: PdApp, serve_ports: ServePorts, demo_dir: Path
) -> None:
    requests = _load(seed=44)
    want = expected_texts(demo_dir, requests)
    before = _decode_stats(app)["kv_share"]
    results = start_load(app, serve_ports.grpc, requests).wait()
    assert failures(results, want) == []
    after = _decode_stats(app)["kv_share"]
    # Every request was handed off, and its decode replica pulled the prompt's blocks.
    assert after["pulled"] - before["pulled"] == len(requests)
    assert after["pulled_blocks"] - before["pulled_blocks"] >= len(requests) * (PROMPT_LEN // 16)
    assert _prefill_stats(app)["kv_share"]["published"] >= len(requests) * (PROMPT_LEN // 16)
    _assert_idle(app)


@dataclass(frozen=True)
class Special:
    """A greedy completion under the adapter, a grammar, or both."""

    prompt: list[int]
    adapter: bool
    grammar: bool
    stream: bool

    def body(self, app: App) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": ADAPTER if self.adapter else app.model,
            "prompt": self.prompt,
            "max_tokens": 60 if self.grammar else 24,
            "temperature": 0.0,
        }
        if self.grammar:
            schema = {"name": "out", "schema": SCHEMA}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        else:
            body["ignore_eos"] = True
        return body


def _specials() -> list[Special]:
    rng = random.Random(46)
    kinds = [(True, False), (False, True), (True, True)]
    return [
        Special(rng.choices(range(300, 3800), k=PROMPT_LEN), adapter, grammar, stream)
        for adapter, grammar in kinds
        for stream in (False, True)
    ]


def _offline(demo_dir: Path, adapter: str, requests: list[Special]) -> list[str]:
    """The offline engine's text for each (float32, as the replicas run)."""
    from workers import LLM, SamplingParams
    from workers.lora.request import LoRARequest
    from workers.structured.spec import StructuredOutputs

    llm = LLM(
        str(demo_dir),
        dtype="float32",
        kv_cache_memory_bytes=256 * 1024 * 1024,
        enable_lora=True,
        max_lora_rank=16,
    )
    lora = LoRARequest(ADAPTER, 1, adapter)
    params = [
        SamplingParams(
            max_tokens=60 if r.grammar else 24,
            temperature=0.0,
            ignore_eos=not r.grammar,
            structured_outputs=StructuredOutputs(json=SCHEMA) if r.grammar else None,
        )
        for r in requests
    ]
    loras = [lora if r.adapter else None for r in requests]
    outs = llm.generate([r.prompt for r in requests], params, use_tqdm=False, lora_request=loras)
    llm.engine.shutdown()
    return [o.outputs[0].text for o in outs]


def _complete(app: App, r: Special) -> str:
    client = openai_client(app)
    body = r.body(app)
    kwargs = {k: body.pop(k) for k in ("model", "prompt", "max_tokens", "temperature")}
    if not r.stream:
        return client.completions.create(**kwargs, extra_body=body).choices[0].text
    chunks = client.completions.create(**kwargs, extra_body=body, stream=True)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def test_adapters_and_grammars_behave_as_on_one_engine(
    app: PdApp, demo_dir: Path, adapter: str
) -> None:
    requests = _specials()
    want = _offline(demo_dir, adapter, requests)
    before = _decode_stats(app)["kv_share"]["pulled"]
    with ThreadPoolExecutor(len(requests)) as pool:
        got = list(pool.map(lambda r: _complete(app, r), requests))
    for r, g, w in zip(requests, got, want, strict=True):
        assert g == w, (r.adapter, r.grammar, r.stream)
        if r.grammar:
            jsonschema.validate(json.loads(g), SCHEMA)
    # Every one was handed off: the adapter's blocks, salted by its id, were pulled too.
    assert _decode_stats(app)["kv_share"]["pulled"] - before == len(requests)
    _assert_idle(app)


def test_a_decode_engine_that_dies_after_the_hand_off_is_a_migration(
    app: PdApp, serve_ports: ServePorts, demo_dir: Path
) -> None:
    """A TP rank of the decode replica dies while every stream is past its hand-off: its
    engine fails, and each request moves on from the tokens it has, exactly."""
    requests = _load(seed=46, min_tokens=96, max_tokens=160)
    want = expected_texts(demo_dir, requests)
    before = _decode_stats(app)
    load = start_load(app, serve_ports.grpc, requests)
    wait_for(lambda: load.streamed_progress() >= 4, "every stream to be under way", 120)
    kill_pid(_rank_pids(_decode_stats(app))[-1])
    assert failures(load.wait(), want) == []
    _assert_idle(app)
    # The engine that served them is gone (at TP > 1 Serve replaces the whole replica).
    after = _decode_stats(app)
    assert (after["pid"], after["engine_pid"]) != (before["pid"], before["engine_pid"])


def test_a_dead_prefill_engine_falls_back_to_the_decode_replica(
    app: PdApp, serve_ports: ServePorts, demo_dir: Path
) -> None:
    """Last: a TP rank of the prefill replica dies, so its engine does, and Serve replaces
    the replica; meanwhile every request is computed by the decode replica, exactly."""
    requests = _load(seed=45)
    want = expected_texts(demo_dir, requests)
    before = _decode_stats(app)["kv_share"]["pulled"]
    kill_pid(_rank_pids(_prefill_stats(app))[-1])
    results = start_load(app, serve_ports.grpc, requests).wait()
    assert failures(results, want) == []
    # Nothing was handed off: the decode replica computed every prompt.
    assert _decode_stats(app)["kv_share"]["pulled"] == before
    stats = wait_until_idle(app, 1)
    assert all(s["kv_blocks_used"] == 0 for s in stats.values()), stats
    _assert_tier_within_budget(app)


def _rank_pids(replica: dict[str, Any]) -> list[int]:
    """The processes of a replica's TP rank actors (the ones it created), from its stats."""
    from cluster.ray_internals import owned_actor_pids

    ranks = owned_actor_pids(replica["pid"], "RankWorker")
    assert len(ranks) == 2, ranks  # TP 2: one actor per rank
    return ranks


def _assert_idle(app: PdApp) -> None:
    for stats in (wait_until_idle(app, 1), {"prefill": _prefill_stats(app)}):
        for s in stats.values():
            assert s["num_requests_running"] == s["num_requests_waiting"] == 0
            assert s["kv_blocks_used"] == 0
    _assert_tier_within_budget(app)


def _assert_tier_within_budget(app: PdApp) -> None:
    """Every object the application added to the store is a block its tier's directory still
    lists (for other requests, within its budget; the decode replica's host tier keeps
    copies, not objects): nothing published, pulled or exported stays pinned. The
    application gone, every object is freed (the fixture's teardown checks)."""
    listed = tier_bytes(app.name)
    assert 0 < listed <= app.share_bytes, listed
    store_bytes_within(app.store_before + listed + STORE_SLACK_BYTES)

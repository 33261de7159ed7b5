"""kvray.v1.LLMService end to end: a real local Ray cluster running `build_app`, real grpcio
clients, the official `openai` client for the HTTP side, and the offline engine as the oracle.

One cluster serves the whole module (auth on, a small waiting-queue cap). The last two tests
stop things (a drained gRPC ingress, then the main application) and must stay last.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from cluster.grpc_api.client import AsyncKvrayClient, KvrayClient, completion_text
from kvray.v1 import llm_pb2
from tests.cluster.serve_helpers import API_KEY, ServePorts
from tests.cluster.serve_helpers import API_KEY_ENV as KEY_ENV

pytestmark = pytest.mark.slow

MAX_QUEUED = 2  # small, so a flood gets RESOURCE_EXHAUSTED
PROMPTS = ["Hello world, this is", "The capital of France"]
CHAT = [{"role": "user", "content": "Tell me a story about a river."}]
CHAT_MAX_TOKENS = 12
LONG = 1500  # max_tokens of requests that must be aborted long before they could finish
WAIT_S = 600.0  # liveness bound of polling loops (never a timing assertion)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _poll(check: Callable[[], Any], what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(interval)
    raise AssertionError(f"gave up waiting for {what}")


def _health(port: int, service: str = "") -> int | None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=10
            )
        except grpc.RpcError:
            return None
        return resp.status


def _wait_serving(port: int) -> None:
    from grpc_health.v1 import health_pb2

    _poll(
        lambda: _health(port) == health_pb2.HealthCheckResponse.SERVING,
        f"gRPC health SERVING on port {port} (is GrpcIngress bound in cluster.app.build_app?)",
        interval=0.5,
    )


@dataclass
class Offline:
    texts: list[str]
    token_ids: list[list[int]]
    ids_prompt: list[int]
    ids_prompt_out: list[int]
    chat_text: str
    chat_ids: list[int]
    chat_prompt_ids: list[int]


@pytest.fixture(scope="module")
def offline() -> Offline:
    """The offline engine's greedy outputs, computed before the cluster starts so the two
    never compete for this machine's CPUs and memory."""
    from workers import LLM, SamplingParams
    from workers.demo import demo_model_dir

    llm = LLM(model=str(demo_model_dir()))
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    ids_prompt = llm.tokenizer.encode("Once upon a time")
    (ids_out,) = llm.generate([ids_prompt], greedy, use_tqdm=False)
    (chat,) = llm.chat(
        CHAT, SamplingParams(max_tokens=CHAT_MAX_TOKENS, temperature=0.0), use_tqdm=False
    )
    result = Offline(
        texts=[o.outputs[0].text for o in outs],
        token_ids=[list(o.outputs[0].token_ids) for o in outs],
        ids_prompt=list(ids_prompt),
        ids_prompt_out=list(ids_out.outputs[0].token_ids),
        chat_text=chat.outputs[0].text,
        chat_ids=list(chat.outputs[0].token_ids),
        chat_prompt_ids=list(chat.prompt_token_ids),
    )
    llm.engine.shutdown()
    return result


@dataclass
class Cluster:
    http_port: int
    grpc_port: int
    config: Any

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def client(self, api_key: str | None = API_KEY, **kw: Any) -> KvrayClient:
        return KvrayClient(self.target, api_key, **kw)

    def stats(self) -> Any:
        from ray import serve

        return serve.get_deployment_handle("LLMServer", "kvray").stats.remote().result()


@pytest.fixture(scope="module")
def cluster(offline: Offline, serve_ports: ServePorts) -> Iterator[Cluster]:
    from ray import serve

    from cluster.app import build_app
    from cluster.config import ServeConfig

    # On the session's Ray and Serve (tests/conftest.py, which runs this module before any
    # other kvray app takes Serve's gRPC port); replicas read the key from the environment
    # that instance started with.
    config = ServeConfig(api_key_env=KEY_ENV, max_queued_requests=MAX_QUEUED)
    serve.run(build_app(config), name="kvray", route_prefix="/")
    try:
        _wait_serving(serve_ports.grpc)
        yield Cluster(serve_ports.http, serve_ports.grpc, config)
    finally:
        for app in ("kvray", "grpc-drain", "grpc-orphan"):
            serve.delete(app)


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> Iterator[KvrayClient]:
    with cluster.client(timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def openai_client(cluster: Cluster) -> Any:
    import openai

    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{cluster.http_port}/v1", api_key=API_KEY, max_retries=0
    )


def _code(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def _wait_idle(cluster: Cluster) -> Any:
    return _poll(
        lambda: (
            (s := cluster.stats()).num_requests_running == 0
            and s.num_requests_waiting == 0
            and s.kv_blocks_used == 0
            and s
        ),
        "the engine to be idle with every KV block free",
    )


# -- answers -----------------------------------------------------------------------------------


def test_health_and_reflection(cluster: Cluster) -> None:
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_health.v1 import health_pb2
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    # Probes carry no credentials: health and reflection answer without the key.
    assert _health(cluster.grpc_port) == health_pb2.HealthCheckResponse.SERVING
    assert (
        _health(cluster.grpc_port, "kvray.v1.LLMService") == health_pb2.HealthCheckResponse.SERVING
    )
    assert _health(cluster.grpc_port, "no.such.Service") is None  # NOT_FOUND

    with grpc.insecure_channel(cluster.target) as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        services = set(db.get_services())
        assert {
            "kvray.v1.LLMService",
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
        } <= services
        # What `grpcurl describe` does: resolve the service and its messages by reflection.
        service = DescriptorPool(db).FindServiceByName("kvray.v1.LLMService")
        stream = service.methods_by_name["GenerateStream"]
        assert stream.server_streaming and stream.input_type.full_name == "kvray.v1.GenerateRequest"


def test_list_models_and_tokenize(client: KvrayClient, offline: Offline) -> None:
    (model,) = client.list_models()
    assert model.id == "kvray-demo" and model.owned_by == "kvray" and model.max_model_len > 0
    assert client.tokenize("Once upon a time") == offline.ids_prompt
    assert client.tokenize(messages=CHAT) == offline.chat_prompt_ids


def test_outputs_equal_the_offline_engine(client: KvrayClient, offline: Offline) -> None:
    for prompt, text, ids in zip(PROMPTS, offline.texts, offline.token_ids, strict=True):
        # Unset max_tokens means 16, as in /v1/completions.
        unary = client.generate(prompt, temperature=0.0)
        (c,) = unary.completions
        assert (c.text, list(c.token_ids)) == (text, ids)
        assert c.finish_reason == llm_pb2.FINISH_REASON_LENGTH
        assert unary.usage.completion_tokens == len(ids)

        pieces = list(client.generate_stream(prompt, temperature=0.0))
        assert "".join(completion_text(p) for p in pieces) == text
        assert [t for p in pieces for c in p.completions for t in c.token_ids] == ids
        assert [p.HasField("usage") for p in pieces] == [False] * (len(pieces) - 1) + [True]
        assert pieces[-1].completions[-1].finish_reason == llm_pb2.FINISH_REASON_LENGTH

    by_ids = client.generate(offline.ids_prompt, temperature=0.0)
    assert list(by_ids.completions[0].token_ids) == offline.ids_prompt_out
    assert by_ids.usage.prompt_tokens == len(offline.ids_prompt)


def test_chat_goes_through_the_template(client: KvrayClient, offline: Offline) -> None:
    resp = client.generate(messages=CHAT, max_tokens=CHAT_MAX_TOKENS, temperature=0.0)
    assert resp.completions[0].text == offline.chat_text
    assert list(resp.completions[0].token_ids) == offline.chat_ids
    assert resp.usage.prompt_tokens == len(offline.chat_prompt_ids)
    streamed = client.generate_stream(messages=CHAT, max_tokens=CHAT_MAX_TOKENS, temperature=0.0)
    assert "".join(completion_text(p) for p in streamed) == offline.chat_text


def test_outputs_equal_the_http_api(
    client: KvrayClient, openai_client: Any, offline: Offline
) -> None:
    http = openai_client.completions.create(
        model="kvray-demo", prompt=PROMPTS[0], max_tokens=16, temperature=0.0
    )
    assert http.choices[0].text == offline.texts[0]
    chat = openai_client.chat.completions.create(
        model="kvray-demo", messages=CHAT, max_tokens=CHAT_MAX_TOKENS, temperature=0.0
    )
    assert chat.choices[0].message.content == offline.chat_text

    # Seeded sampling: the same options mean the same draw on both APIs.
    opts = dict(temperature=0.9, top_p=0.95, seed=7, max_tokens=12)
    http_sampled = openai_client.completions.create(
        model="kvray-demo", prompt=PROMPTS[1], extra_body={"top_k": 40}, **opts
    )
    grpc_sampled = client.generate(PROMPTS[1], top_k=40, **opts)
    assert completion_text(grpc_sampled) == http_sampled.choices[0].text

    # n = 2 with a seed: both samples, in index order, equal the HTTP API's.
    http_n = openai_client.completions.create(model="kvray-demo", prompt=PROMPTS[0], n=2, **opts)
    grpc_n = client.generate(PROMPTS[0], n=2, **opts)
    assert [c.index for c in grpc_n.completions] == [0, 1]
    assert [c.text for c in grpc_n.completions] == [
        c.text for c in sorted(http_n.choices, key=lambda c: c.index)
    ]


def test_logprobs_equal_the_http_api(client: KvrayClient, openai_client: Any) -> None:
    resp = client.generate(PROMPTS[0], max_tokens=6, temperature=0.0, top_logprobs=2)
    (c,) = resp.completions
    assert [lp.token_id for lp in c.logprobs] == list(c.token_ids)
    for lp in c.logprobs:
        assert len(lp.top_logprobs) == 2
        assert lp.top_logprobs[0].logprob >= lp.top_logprobs[1].logprob
        assert lp.top_logprobs[0].token_id == lp.token_id  # greedy picks the top token

    http = openai_client.completions.create(
        model="kvray-demo", prompt=PROMPTS[0], max_tokens=6, temperature=0.0, logprobs=2
    )
    hl = http.choices[0].logprobs
    assert [lp.token for lp in c.logprobs] == hl.tokens
    assert [lp.logprob for lp in c.logprobs] == pytest.approx(hl.token_logprobs, abs=1e-6)
    for lp, top in zip(c.logprobs, hl.top_logprobs, strict=True):
        assert {t.token: pytest.approx(t.logprob, abs=1e-6) for t in lp.top_logprobs} == top

    streamed = list(
        client.generate_stream(PROMPTS[0], max_tokens=6, temperature=0.0, top_logprobs=2)
    )
    assert [lp for p in streamed for s in p.completions for lp in s.logprobs] == list(c.logprobs)


# -- errors ------------------------------------------------------------------------------------


def test_invalid_arguments_name_the_field(client: KvrayClient, cluster: Cluster) -> None:
    cases: list[tuple[llm_pb2.GenerateRequest, str]] = [
        (llm_pb2.GenerateRequest(), "input"),
        (llm_pb2.GenerateRequest(text=""), "text"),
        (llm_pb2.GenerateRequest(token_ids=llm_pb2.TokenIds(ids=[10**6])), "token_ids"),
        (
            llm_pb2.GenerateRequest(text="x", sampling=llm_pb2.SamplingParams(top_p=1.5)),
            "sampling.top_p",
        ),
        (
            llm_pb2.GenerateRequest(text="x", sampling=llm_pb2.SamplingParams(max_tokens=0)),
            "sampling.max_tokens",
        ),
        (llm_pb2.GenerateRequest(text="x", sampling=llm_pb2.SamplingParams(n=0)), "sampling.n"),
        (
            llm_pb2.GenerateRequest(text="x", sampling=llm_pb2.SamplingParams(temperature=-1.0)),
            "sampling.temperature",
        ),
        (
            llm_pb2.GenerateRequest(text="x", logprobs=llm_pb2.LogprobsOptions(top_logprobs=99)),
            "logprobs.top_logprobs",
        ),
        (
            # prompt + max_tokens beyond the model's context length
            llm_pb2.GenerateRequest(text="x", sampling=llm_pb2.SamplingParams(max_tokens=10**6)),
            "sampling.max_tokens",
        ),
        (
            llm_pb2.GenerateRequest(
                chat=llm_pb2.ChatMessages(messages=[llm_pb2.ChatMessage(role="robot", content="x")])
            ),
            "chat.messages[0].role",
        ),
    ]
    from kvray.v1 import llm_pb2_grpc

    metadata = (("authorization", f"Bearer {API_KEY}"),)
    with grpc.insecure_channel(cluster.target) as ch:
        stub = llm_pb2_grpc.LLMServiceStub(ch)
        for req, field in cases:
            for method in (stub.Generate, lambda r, **kw: list(stub.GenerateStream(r, **kw))):
                code, details = _code(lambda m=method, r=req: m(r, metadata=metadata, timeout=120))
                assert code is grpc.StatusCode.INVALID_ARGUMENT, (field, details)
                assert details.startswith(f"{field}: "), (field, details)


def test_unknown_model_is_not_found(client: KvrayClient) -> None:
    code, details = _code(lambda: client.generate("x", model="gpt-17"))
    assert code is grpc.StatusCode.NOT_FOUND and "gpt-17" in details
    code, _ = _code(lambda: client.tokenize("x", model="gpt-17"))
    assert code is grpc.StatusCode.NOT_FOUND


def test_missing_or_wrong_key_is_unauthenticated(cluster: Cluster) -> None:
    for key in (None, "wrong-key"):
        with cluster.client(api_key=key) as c:
            assert _code(lambda c=c: c.generate("x"))[0] is grpc.StatusCode.UNAUTHENTICATED
            assert (
                _code(lambda c=c: list(c.generate_stream("x")))[0]
                is grpc.StatusCode.UNAUTHENTICATED
            )
            assert _code(lambda c=c: c.list_models())[0] is grpc.StatusCode.UNAUTHENTICATED


def test_request_over_the_size_limit_is_resource_exhausted(client: KvrayClient) -> None:
    limit = 4 * 1024 * 1024  # ServeConfig.grpc_max_message_bytes default, not the proxy's 2 GiB
    code, details = _code(lambda: client.generate("a" * (limit + 1)))
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED, details


def test_a_flood_past_the_queue_cap_is_resource_exhausted(cluster: Cluster) -> None:
    long_prompt = list(range(100, 1100))  # 1000 tokens: a slow prefill keeps requests waiting

    async def flood() -> list[grpc.StatusCode]:
        async with AsyncKvrayClient(cluster.target, API_KEY, timeout=600) as c:

            async def one() -> grpc.StatusCode:
                try:
                    await c.generate(long_prompt, max_tokens=2, temperature=0.0)
                except grpc.aio.AioRpcError as err:
                    return err.code()
                return grpc.StatusCode.OK

            return await asyncio.gather(*(one() for _ in range(24)))

    codes = asyncio.run(flood())
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
    assert grpc.StatusCode.OK in codes
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
    _wait_idle(cluster)


# -- cancellation and deadlines -----------------------------------------------------------------


def test_client_cancel_aborts_the_engine_request(cluster: Cluster) -> None:
    before = _wait_idle(cluster)
    with cluster.client() as c:
        stream = c._stub.GenerateStream(
            llm_pb2.GenerateRequest(
                text=PROMPTS[0],
                sampling=llm_pb2.SamplingParams(max_tokens=LONG, ignore_eos=True, temperature=0.0),
            ),
            metadata=(("authorization", f"Bearer {API_KEY}"),),
        )
        first = next(stream)
        assert first.completions[0].token_ids
        assert cluster.stats().kv_blocks_used > 0  # the request holds KV blocks now
        stream.cancel()
        assert _code(lambda: next(stream))[0] is grpc.StatusCode.CANCELLED
    after = _wait_idle(cluster)  # every KV block back
    assert after.generation_tokens - before.generation_tokens < LONG  # stopped early: aborted


def test_deadline_aborts_the_engine_request(cluster: Cluster) -> None:
    before = _wait_idle(cluster)
    with cluster.client() as c:
        for call in (
            lambda: c.generate(PROMPTS[0], max_tokens=LONG, ignore_eos=True, timeout=2.0),
            lambda: list(
                c.generate_stream(PROMPTS[1], max_tokens=LONG, ignore_eos=True, timeout=2.0)
            ),
        ):
            assert _code(call)[0] is grpc.StatusCode.DEADLINE_EXCEEDED
    after = _wait_idle(cluster)
    assert after.generation_tokens - before.generation_tokens < 2 * LONG


# -- lifecycle (these stop things: keep them last) ----------------------------------------------


def _extra_ingress(cluster: Cluster, name: str, **settings: Any) -> int:
    """Another GrpcIngress application on its own port, calling the main app's LLMServer."""
    from ray import serve

    from cluster.grpc_api.ingress import GrpcSettings, bind_grpc_ingress

    port = _free_port()
    llm = serve.get_deployment_handle("LLMServer", "kvray")
    opts = GrpcSettings.from_config(cluster.config, host="127.0.0.1", port=port, **settings)
    serve.run(bind_grpc_ingress(cluster.config, llm, opts), name=name, route_prefix=None)
    _wait_serving(port)
    return port


def test_draining_is_not_serving_and_finishes_in_flight_calls(cluster: Cluster) -> None:
    from grpc_health.v1 import health_pb2
    from ray import serve

    port = _extra_ingress(cluster, "grpc-drain", drain_s=10.0, grace_s=60.0)
    with KvrayClient(f"127.0.0.1:{port}", API_KEY, timeout=600) as c:
        stream = c.generate_stream(PROMPTS[0], max_tokens=200, ignore_eos=True, temperature=0.0)
        pieces = [next(stream)]
        serve.delete("grpc-drain", _blocking=False)
        _poll(
            lambda: _health(port) == health_pb2.HealthCheckResponse.NOT_SERVING,
            "health NOT_SERVING while the ingress drains",
            interval=0.02,
        )
        # Still accepting while load balancers catch up, and the in-flight stream completes.
        assert c.generate(PROMPTS[1], max_tokens=2, temperature=0.0).usage.completion_tokens == 2
        pieces += list(stream)
    assert sum(len(c.token_ids) for p in pieces for c in p.completions) == 200
    assert pieces[-1].completions[-1].finish_reason == llm_pb2.FINISH_REASON_LENGTH


def test_no_engine_replica_is_unavailable(cluster: Cluster) -> None:
    from ray import serve

    port = _extra_ingress(cluster, "grpc-orphan")
    serve.delete("kvray")  # the LLMServer deployment is gone for good
    with KvrayClient(f"127.0.0.1:{port}", API_KEY, timeout=120) as c:
        code, details = _code(lambda: c.generate(PROMPTS[0], max_tokens=2))
        assert code is grpc.StatusCode.UNAVAILABLE, details
        assert _code(lambda: list(c.generate_stream(PROMPTS[0])))[0] is grpc.StatusCode.UNAVAILABLE

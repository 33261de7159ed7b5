"""kvray.v1.LLMService's status codes end to end: bad arguments, unknown models, missing keys,
oversized and excess requests, and cancelled or timed-out calls aborting their engine request.
On the app of tests/cluster/grpc_api/conftest.py."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from cluster.grpc_api.client import AsyncKvrayClient, KvrayClient
from kvray.v1 import llm_pb2
from tests.cluster.grpc_api.grpc_helpers import (
    LONG,
    PROMPTS,
    Cluster,
    rpc_status,
    wait_idle,
)
from tests.cluster.serve_helpers import API_KEY

pytestmark = pytest.mark.slow


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
                code, details = rpc_status(
                    lambda m=method, r=req: m(r, metadata=metadata, timeout=120)
                )
                assert code is grpc.StatusCode.INVALID_ARGUMENT, (field, details)
                assert details.startswith(f"{field}: "), (field, details)


def test_unknown_model_is_not_found(client: KvrayClient) -> None:
    code, details = rpc_status(lambda: client.generate("x", model="gpt-17"))
    assert code is grpc.StatusCode.NOT_FOUND and "gpt-17" in details
    code, _ = rpc_status(lambda: client.tokenize("x", model="gpt-17"))
    assert code is grpc.StatusCode.NOT_FOUND


def test_missing_or_wrong_key_is_unauthenticated(cluster: Cluster) -> None:
    for key in (None, "wrong-key"):
        with cluster.client(api_key=key) as c:
            assert rpc_status(lambda c=c: c.generate("x"))[0] is grpc.StatusCode.UNAUTHENTICATED
            assert (
                rpc_status(lambda c=c: list(c.generate_stream("x")))[0]
                is grpc.StatusCode.UNAUTHENTICATED
            )
            assert rpc_status(lambda c=c: c.list_models())[0] is grpc.StatusCode.UNAUTHENTICATED


def test_request_over_the_size_limit_is_resource_exhausted(client: KvrayClient) -> None:
    limit = 4 * 1024 * 1024  # grpc_max_message_bytes default, not the proxy's 2 GiB
    code, details = rpc_status(lambda: client.generate("a" * (limit + 1)))
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
    wait_idle(cluster)


# -- cancellation and deadlines -----------------------------------------------------------------


def test_client_cancel_aborts_the_engine_request(cluster: Cluster) -> None:
    before = wait_idle(cluster)
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
        assert rpc_status(lambda: next(stream))[0] is grpc.StatusCode.CANCELLED
    after = wait_idle(cluster)  # every KV block back
    assert after.generation_tokens - before.generation_tokens < LONG  # stopped early: aborted


def test_deadline_aborts_the_engine_request(cluster: Cluster) -> None:
    before = wait_idle(cluster)
    with cluster.client() as c:
        for call in (
            lambda: c.generate(PROMPTS[0], max_tokens=LONG, ignore_eos=True, timeout=2.0),
            lambda: list(
                c.generate_stream(PROMPTS[1], max_tokens=LONG, ignore_eos=True, timeout=2.0)
            ),
        ):
            assert rpc_status(call)[0] is grpc.StatusCode.DEADLINE_EXCEEDED
    after = wait_idle(cluster)
    assert after.generation_tokens - before.generation_tokens < 2 * LONG

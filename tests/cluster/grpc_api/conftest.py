"""The kvray app the gRPC end-to-end modules share: one deployment for all of them.

test_grpc_answers, test_grpc_errors and test_grpc_lifecycle run against one application (auth
on, a small waiting-queue cap) bound to Serve's gRPC port. The fixtures are package-scoped so
it is deployed once, and tests/conftest.py runs the three modules back to back, before any
other kvray application could take that port, with test_grpc_lifecycle (which stops things)
last.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from cluster.grpc_api.client import KvrayClient
from tests.cluster.grpc_api.grpc_helpers import (
    CHAT,
    CHAT_MAX_TOKENS,
    MAX_QUEUED,
    PROMPTS,
    Cluster,
    Offline,
    wait_serving,
)
from tests.cluster.serve_helpers import API_KEY, TEST_GRPC_DRAIN_S, ServePorts
from tests.cluster.serve_helpers import API_KEY_ENV as KEY_ENV


@pytest.fixture(scope="package")
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


@pytest.fixture(scope="package")
def cluster(offline: Offline, serve_ports: ServePorts) -> Iterator[Cluster]:
    from ray import serve

    from cluster.config import ServeConfig
    from cluster.deploy.app import build_app

    # On the session's Ray and Serve (tests/conftest.py, which runs these modules before any
    # other kvray app takes Serve's gRPC port); replicas read the key from the environment
    # that instance started with.
    config = ServeConfig.from_flat(
        grpc_drain_s=TEST_GRPC_DRAIN_S, api_key_env=KEY_ENV, max_queued_requests=MAX_QUEUED
    )
    serve.run(build_app(config), name="kvray", route_prefix="/")
    try:
        wait_serving(serve_ports.grpc)
        yield Cluster(serve_ports.http, serve_ports.grpc, config)
    finally:
        for app in ("kvray", "grpc-drain", "grpc-orphan"):
            serve.delete(app)


@pytest.fixture(scope="package")
def client(cluster: Cluster) -> Iterator[KvrayClient]:
    with cluster.client(timeout=300) as c:
        yield c


@pytest.fixture(scope="package")
def openai_client(cluster: Cluster) -> Any:
    import openai

    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{cluster.http_port}/v1", api_key=API_KEY, max_retries=0
    )

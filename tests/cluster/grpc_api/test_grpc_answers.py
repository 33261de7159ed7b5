"""kvray.v1.LLMService's answers end to end: a real local Ray cluster running `build_app`
(tests/cluster/grpc_api/conftest.py), real grpcio clients, the official `openai` client for the
HTTP side, and the offline engine as the oracle."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.grpc_api.client import KvrayClient, completion_text
from kvray.v1 import llm_pb2
from tests.cluster.grpc_api.grpc_helpers import (
    CHAT,
    CHAT_MAX_TOKENS,
    PROMPTS,
    Offline,
)

pytestmark = pytest.mark.slow


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

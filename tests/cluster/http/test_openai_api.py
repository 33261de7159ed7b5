"""The OpenAI-compatible HTTP API end to end: real Ray Serve, 2 replicas, the official client.

Greedy outputs must equal the offline engine's (`workers.LLM`) on the same demo checkpoint.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.cluster.serve_helpers import (
    KV_CACHE_BYTES,
    App,
    openai_client,
    replica_stats,
    wait_until_idle,
)
from workers import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["Once upon a time", "The train leaves at", "def fibonacci(n):"]
CHAT = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name three rivers."},
]


@pytest.fixture(scope="module")
def llm(demo_dir: Path) -> Any:
    from workers import LLM

    return LLM(model=str(demo_dir), kv_cache_memory_bytes=KV_CACHE_BYTES)


@pytest.fixture(scope="module")
def client(kvray_app: App) -> openai.OpenAI:
    return openai_client(kvray_app)


def _greedy(llm: Any, prompts: list[str], max_tokens: int, **kw: Any) -> list[Any]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)
    return llm.generate(prompts, params, use_tqdm=False)


def test_models_lists_the_served_model(client: openai.OpenAI, kvray_app: App) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [kvray_app.model]
    assert models[0].model_extra["max_model_len"] > 0
    assert models[0].model_extra["quantization"] == "none"
    assert models[0].model_extra["kv_cache_dtype"] == "float32"  # the CPU replicas' default


def test_completions_greedy_equal_offline(client: openai.OpenAI, llm: Any) -> None:
    ref = _greedy(llm, PROMPTS, 24)
    expected = [o.outputs[0].text for o in ref]
    # One batched request (list of prompts) and one streamed request per prompt.
    resp = client.completions.create(
        model="kvray-demo", prompt=PROMPTS, max_tokens=24, temperature=0
    )
    assert [c.text for c in sorted(resp.choices, key=lambda c: c.index)] == expected
    assert resp.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in ref)
    assert resp.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in ref)
    for prompt, want in zip(PROMPTS, expected, strict=True):
        stream = client.completions.create(
            model="kvray-demo", prompt=prompt, max_tokens=24, temperature=0, stream=True
        )
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_chat_greedy_equal_offline(client: openai.OpenAI, llm: Any) -> None:
    params = SamplingParams(max_tokens=20, temperature=0.0)
    want = llm.chat(CHAT, params, use_tqdm=False)[0].outputs[0].text
    resp = client.chat.completions.create(
        model="kvray-demo", messages=CHAT, max_completion_tokens=20, temperature=0
    )
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == want
    stream = client.chat.completions.create(
        model="kvray-demo", messages=CHAT, max_tokens=20, temperature=0, stream=True
    )
    chunks = [c for c in stream if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want


def test_n2_and_seeded_sampling_reproducible(client: openai.OpenAI) -> None:
    kw = {"model": "kvray-demo", "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 1.0}
    first = client.completions.create(n=2, seed=1234, **kw)
    again = client.completions.create(n=2, seed=1234, **kw)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(first.choices, key=lambda c: c.index)] == [0, 1]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert texts[0] != texts[1]  # two samples, not one copied
    assert 2 <= first.usage.completion_tokens <= 32
    # Streaming with the same seed reassembles to the same two samples.
    stream = client.completions.create(n=2, seed=1234, stream=True, **kw)
    parts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            parts[c.index] += c.text
    assert [parts[0], parts[1]] == texts
    other = client.completions.create(n=1, seed=99, **kw)
    assert other.choices[0].text != texts[0] or other.choices[0].text != texts[1]


def test_completion_logprobs_match_offline(client: openai.OpenAI, llm: Any) -> None:
    ref = _greedy(llm, [PROMPTS[1]], 8, logprobs=3)[0].outputs[0]
    resp = client.completions.create(
        model="kvray-demo", prompt=PROMPTS[1], max_tokens=8, temperature=0, logprobs=3
    )
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(ref.token_ids) == 8
    assert "".join(lp.tokens) == resp.choices[0].text
    for got, top, tid, want in zip(
        lp.token_logprobs, lp.top_logprobs, ref.token_ids, ref.logprobs, strict=True
    ):
        assert got == pytest.approx(want[tid], abs=1e-3)
        assert len(top) <= 3 and max(top.values()) == pytest.approx(got, abs=1e-3)


def test_chat_logprobs_streamed(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="kvray-demo",
        messages=CHAT,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    entries, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.logprobs and c.logprobs.content:
                entries.extend(c.logprobs.content)
    assert usage is not None and len(entries) == usage.completion_tokens == 6
    for e in entries:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-4)


def test_stop_string(client: openai.OpenAI, llm: Any) -> None:
    text = _greedy(llm, [PROMPTS[0]], 24)[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    resp = client.completions.create(
        model="kvray-demo", prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop]
    )
    assert resp.choices[0].text == text[: text.index(stop)]
    assert resp.choices[0].finish_reason == "stop"


def test_include_usage_and_cached_prompt_tokens(client: openai.OpenAI, demo_dir: Path) -> None:
    prompt = list(range(100, 180))  # 80 tokens = 5 full KV blocks
    usages = []
    for _ in range(2):
        stream = client.completions.create(
            model="kvray-demo",
            prompt=prompt,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = list(stream)
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert all(c.usage is None for c in chunks[:-1])
        usages.append(chunks[-1].usage)
    assert usages[0].prompt_tokens == 80 and usages[0].completion_tokens == 5
    assert usages[0].total_tokens == 85
    # The prefix-affinity router sends the repeat to the replica that cached the prompt.
    assert usages[1].prompt_tokens_details.cached_tokens >= 64


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
        ("/v1/completions", {"prompt": "hi", "top_k": 0}, "top_k"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 10**6}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "hi", "min_tokens": 9, "max_tokens": 2}, "min_tokens"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": [10**7]}, "prompt"),
        ("/v1/completions", {"prompt": {"text": "hi"}}, "prompt"),
        ("/v1/completions", {}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "tools": [{"type": "function"}]},
            "tools[0].function",
        ),
        ("/tokenize", {}, "prompt"),
        ("/detokenize", {"tokens": [-5]}, "tokens"),
    ],
)
def test_bad_input_is_400_naming_the_field(
    kvray_app: App, path: str, body: dict[str, Any], param: str
) -> None:
    r = httpx.post(
        f"{kvray_app.base_url}{path}",
        json={"model": kvray_app.model, **body},
        headers={"Authorization": f"Bearer {kvray_app.api_key}"},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error" and err["message"]


def test_prompt_beyond_max_model_len_names_the_limit(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="kvray-demo", prompt=[5] * 3000, max_tokens=4)
    assert "max_model_len" in info.value.body["message"]
    assert info.value.body["param"] == "prompt"


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-17", prompt="hi", max_tokens=2)
    assert info.value.body["param"] == "model"


def test_tokenize_detokenize_round_trip(kvray_app: App) -> None:
    headers = {"Authorization": f"Bearer {kvray_app.api_key}"}
    r = httpx.post(f"{kvray_app.base_url}/tokenize", json={"prompt": PROMPTS[2]}, headers=headers)
    body = r.json()
    assert r.status_code == 200 and body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] > 0
    r = httpx.post(
        f"{kvray_app.base_url}/detokenize", json={"tokens": body["tokens"]}, headers=headers
    )
    assert r.json() == {"prompt": PROMPTS[2]}
    chat = httpx.post(f"{kvray_app.base_url}/tokenize", json={"messages": CHAT}, headers=headers)
    assert chat.status_code == 200 and chat.json()["count"] > body["count"]


def test_health_and_ready_need_no_key(kvray_app: App) -> None:
    assert httpx.get(f"{kvray_app.base_url}/health").status_code == 200
    assert httpx.get(f"{kvray_app.base_url}/ready").status_code == 200


def test_served_by_haproxy_and_engine_processes(kvray_app: App) -> None:
    """The fast path is the one under test: HAProxy holds the HTTP port (Serve's Python
    proxy does not), and each replica's engine core is its own process."""
    port = int(kvray_app.base_url.split(":")[-1].split("/")[0])
    owners = {_cmdline(pid) for pid in _listening_pids(port)}
    assert owners and all("haproxy" in c for c in owners), owners
    stats = replica_stats(kvray_app, 2)
    assert [s["engine_core"] for s in stats.values()] == ["process", "process"]


def _listening_pids(port: int) -> set[int]:
    """Processes holding a listening TCP socket on `port` (Linux /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":  # LISTEN
                    inodes.add(cols[9])
    pids = set()
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            links = {os.readlink(fd) for fd in fd_dir.iterdir()}
        except OSError:
            continue
        if any(f"socket:[{i}]" in links for i in inodes):
            pids.add(int(fd_dir.parent.name))
    return pids


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_disconnect_mid_stream_frees_every_kv_block(kvray_app: App) -> None:
    body = {
        "model": kvray_app.model,
        "prompt": list(range(200, 264)),
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {kvray_app.api_key}"}
    with httpx.Client(timeout=60) as http:
        with http.stream(
            "POST", f"{kvray_app.base_url}/v1/completions", json=body, headers=headers
        ) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
            busy = replica_stats(kvray_app, 2)
            assert len(busy) == 2
            assert sum(s["num_requests_running"] for s in busy.values()) == 1
        # Leaving the block closes the connection mid-stream.
    stats = wait_until_idle(kvray_app, 2)
    assert len(stats) == 2
    for s in stats.values():
        assert s["num_requests_running"] == 0 and s["kv_blocks_used"] == 0, s


def test_disconnect_while_waiting_for_a_non_streamed_answer(kvray_app: App) -> None:
    body = {
        "model": kvray_app.model,
        "prompt": list(range(300, 340)),
        "max_tokens": 1500,
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {kvray_app.api_key}"}

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            task = asyncio.create_task(
                http.post(f"{kvray_app.base_url}/v1/completions", json=body, headers=headers)
            )
            deadline = time.monotonic() + 60
            running = False
            while not running and time.monotonic() < deadline:  # until a replica runs it
                stats = await asyncio.to_thread(replica_stats, kvray_app, 2)
                running = any(s["num_requests_running"] for s in stats.values())
                await asyncio.sleep(0.1)
            assert running, "the request never started on a replica"
            task.cancel()  # closes the connection
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(scenario())
    stats = wait_until_idle(kvray_app, 2)
    for s in stats.values():
        assert s["num_requests_running"] == 0 and s["kv_blocks_used"] == 0, s

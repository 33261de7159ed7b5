"""echo, scoring-only requests and prompt logprobs end to end: the shared app (real Ray Serve,
2 replicas), the official `openai` client and httpx, transformers as the oracle of the
prompt's log-probabilities."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.cluster.serve_helpers import App, openai_client

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time, in a quiet village by the sea,"


@pytest.fixture(scope="module")
def client(kvray_app: App) -> openai.OpenAI:
    return openai_client(kvray_app)


@pytest.fixture(scope="module")
def tokenizer(demo_dir: Path) -> Any:
    from workers.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(demo_dir)


def _post(app: App, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{app.base_url}{path}",
        json={"model": app.model, **body},
        headers={"Authorization": f"Bearer {app.api_key}"},
        timeout=120,
    )


def _reference_logprobs(demo_dir: Path, ids: list[int]) -> list[float]:
    """transformers' log-probability of each prompt token after the first (float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))]


def test_prompt_logprobs_equal_transformers_with_the_prefix_cache_warm(
    kvray_app: App, client: openai.OpenAI, tokenizer: Any, demo_dir: Path
) -> None:
    ids = tokenizer.encode(PROMPT)
    # The prompt is in the prefix cache before it is scored, and again for the second score.
    client.completions.create(model=kvray_app.model, prompt=PROMPT, max_tokens=2, temperature=0)
    answers = []
    for _ in range(2):
        r = _post(
            kvray_app, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 0}
        )
        assert r.status_code == 200, r.text
        answers.append(r.json()["choices"][0]["prompt_logprobs"])
    assert answers[0] == answers[1]
    got = answers[0]
    assert got[0] is None and len(got) == len(ids)
    values = [entry[str(t)]["logprob"] for t, entry in zip(ids[1:], got[1:], strict=True)]
    ref = _reference_logprobs(demo_dir, ids)
    assert max(abs(a - b) for a, b in zip(values, ref, strict=True)) < 1e-4
    # echo's legacy logprobs carry the same values.
    echoed = client.completions.create(
        model=kvray_app.model, prompt=ids, echo=True, logprobs=0, max_tokens=0
    )
    head, *rest = echoed.choices[0].logprobs.token_logprobs
    assert head is None and rest == pytest.approx(values, abs=1e-6)


def test_echo_puts_the_prompt_before_the_completion(
    kvray_app: App, client: openai.OpenAI, tokenizer: Any
) -> None:
    kw: dict[str, Any] = {"model": kvray_app.model, "max_tokens": 5, "temperature": 0}
    plain = client.completions.create(prompt=PROMPT, logprobs=2, **kw)
    echoed = client.completions.create(prompt=PROMPT, logprobs=2, echo=True, **kw)
    (p,), (e,) = plain.choices, echoed.choices
    assert e.text == PROMPT + p.text and e.finish_reason == p.finish_reason
    n = len(tokenizer.encode(PROMPT))
    lps = e.logprobs
    assert len(lps.tokens) == n + len(p.logprobs.tokens) == echoed.usage.total_tokens
    assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
    assert all(v is not None for v in lps.token_logprobs[1:])
    assert all(len(top) >= 1 for top in lps.top_logprobs[1:])
    # Offsets into the echoed text: the prompt's tokens, then the completion's after it.
    assert lps.text_offset[0] == 0 and lps.text_offset == sorted(lps.text_offset)
    assert lps.text_offset[n] == len(PROMPT)
    assert lps.text_offset[n:] == [len(PROMPT) + o for o in p.logprobs.text_offset]
    assert lps.tokens[n:] == p.logprobs.tokens
    assert lps.token_logprobs[n:] == pytest.approx(p.logprobs.token_logprobs, abs=1e-5)
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens


def test_scoring_only_answers_the_prompt_alone(
    kvray_app: App, client: openai.OpenAI, tokenizer: Any
) -> None:
    r = client.completions.create(
        model=kvray_app.model, prompt=PROMPT, echo=True, max_tokens=0, logprobs=1
    )
    (c,) = r.choices
    n = len(tokenizer.encode(PROMPT))
    assert c.text == PROMPT and c.finish_reason == "length"
    assert len(c.logprobs.tokens) == n and r.usage.completion_tokens == 0
    assert c.logprobs.token_logprobs[0] is None
    assert all(v is not None for v in c.logprobs.token_logprobs[1:])
    assert r.usage.prompt_tokens == n
    bad = _post(kvray_app, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_token_id_prompts_and_samples_each_echo_their_prompt(
    kvray_app: App, client: openai.OpenAI, tokenizer: Any
) -> None:
    prompts = [tokenizer.encode("The train leaves at"), tokenizer.encode("<|im_start|>user\nHi")]
    r = client.completions.create(
        model=kvray_app.model, prompt=prompts, n=2, echo=True, max_tokens=3, temperature=0.8
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        ids = prompts[c.index // 2]
        assert c.text.startswith(tokenizer.decode(ids, skip_special_tokens=False))
    assert r.choices[2].text.startswith("<|im_start|>user\nHi")


def test_a_stream_echoes_in_its_first_chunk(
    kvray_app: App, client: openai.OpenAI, tokenizer: Any
) -> None:
    kw: dict[str, Any] = {"model": kvray_app.model, "prompt": PROMPT, "temperature": 0}
    whole = client.completions.create(echo=True, logprobs=1, max_tokens=6, **kw)
    chunks = list(client.completions.create(echo=True, logprobs=1, max_tokens=6, stream=True, **kw))
    n = len(tokenizer.encode(PROMPT))
    first = chunks[0].choices[0]
    assert first.text.startswith(PROMPT) and len(first.logprobs.tokens) >= n
    assert first.logprobs.token_logprobs[0] is None
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    offsets = [
        o
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for o in c.choices[0].logprobs.text_offset
    ]
    assert offsets == whole.choices[0].logprobs.text_offset

    scored = list(client.completions.create(echo=True, max_tokens=0, stream=True, **kw))
    texts = [c.choices[0].text for c in scored if c.choices]
    assert texts == [PROMPT] and scored[-1].choices[0].finish_reason == "length"


def test_vllm_prompt_logprobs_field(kvray_app: App, tokenizer: Any) -> None:
    ids = tokenizer.encode(PROMPT)
    r = _post(kvray_app, "/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for tid, entry in zip(ids[1:], got[1:], strict=True):
        assert next(iter(entry)) == str(tid)  # the prompt's token first
        assert 2 <= len(entry) <= 3
        ranks = sorted(e["rank"] for e in entry.values() if e["rank"] is not None)
        assert ranks[:2] == [1, 2]
        assert all(
            e["decoded_token"] == tokenizer.decode([int(t)], skip_special_tokens=False)
            for t, e in entry.items()
        )

    chat = _post(
        kvray_app,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0},
    )
    assert chat.status_code == 200, chat.text
    body = chat.json()
    assert (
        body["prompt_logprobs"][0] is None
        and len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    )
    streamed = _post(
        kvray_app, "/v1/completions", {"prompt": PROMPT, "stream": True, "prompt_logprobs": 1}
    )
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"

"""POST /tokenize and /detokenize (cluster/http/token_routes.py) on the demo tokenizer, without
Ray: a stand-in ingress gives the routes what OpenAIIngress does."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from cluster.errors import KvrayError
from cluster.http.token_routes import add_token_routes
from cluster.ingress.limits import DEFAULT_LIMITS
from cluster.ingress.lora_catalog import ModelTarget
from cluster.ingress.prompts import Prompts


class Client:
    async def model_card(self) -> dict[str, Any]:
        return {"max_model_len": 2048}


class Lora:
    async def target(self, model: str | None) -> ModelTarget:
        return ModelTarget("kvray-demo")


class SpyPrompts(Prompts):
    """The demo tokenizer's Prompts, remembering the template variables of each chat."""

    seen: list[Any]

    async def chat(self, *args: Any, **kwargs: Any) -> list[int]:
        self.seen.append(kwargs.get("template_kwargs"))
        return await super().chat(*args, **kwargs)


class Ingress:
    def __init__(self) -> None:
        from workers.demo import demo_model_dir
        from workers.tokenizer import Tokenizer

        self.client = Client()
        self.lora = Lora()
        self.limits = DEFAULT_LIMITS
        self.prompts = SpyPrompts(Tokenizer.from_pretrained(demo_model_dir()))
        self.prompts.seen = []


@pytest.fixture(scope="module")
def api() -> tuple[TestClient, Ingress]:
    ingress = Ingress()
    app = FastAPI()

    @app.exception_handler(KvrayError)
    async def _error(_: Any, err: KvrayError) -> JSONResponse:
        return JSONResponse(err.to_openai(), status_code=err.http_status)

    add_token_routes(app, ingress)  # type: ignore[arg-type]
    return TestClient(app), ingress


USER = [{"role": "user", "content": "Hi"}]


def test_a_chat_is_tokenized_with_its_template_kwargs(api: tuple[TestClient, Ingress]) -> None:
    client, ingress = api
    kwargs = {"enable_thinking": False}
    got = client.post("/tokenize", json={"messages": USER, "chat_template_kwargs": kwargs})
    assert got.status_code == 200, got.text
    plain = client.post("/tokenize", json={"messages": USER}).json()
    assert got.json()["tokens"] == plain["tokens"]  # the demo template reads no variables
    assert ingress.prompts.seen[-2:] == [kwargs, None]


def test_reserved_template_kwargs_are_a_400(api: tuple[TestClient, Ingress]) -> None:
    client, _ = api
    got = client.post(
        "/tokenize", json={"messages": USER, "chat_template_kwargs": {"add_generation_prompt": 0}}
    )
    assert got.status_code == 400 and got.json()["error"]["param"] == "chat_template_kwargs"

"""GET /v1/models, and the LoRA adapter routes (vLLM's), added to the HTTP ingress's app.

- GET /v1/models: the served model, then each adapter (the config's in order, then those
  loaded at run time) with `parent` = the served model's id and `root` = its path.
- POST /v1/load_lora_adapter {"lora_name", "lora_path"}: 200 and a line of text once every
  ingress can serve it; 400 naming the field for a missing field, a name already served or
  the served model's, or an adapter the engines could not serve (the message names its file
  and field).
- POST /v1/unload_lora_adapter {"lora_name"}: 200 and a line of text; new requests naming
  it get 404 from then on, running ones finish under it; 404 for a name not loaded.

The two POST routes exist only with `enable_runtime_lora`: without it they are absent (404,
as vLLM without runtime updating), and not in the OpenAPI document. The API key guards them
like every route (cluster/http/guard.py).
"""

from __future__ import annotations

from typing import Any, Protocol

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from cluster.ingress.llm_client import LLMClient
from cluster.ingress.lora_catalog import LoraCatalog

OWNED_BY = "kvray"


class Ingress(Protocol):
    """What the routes use of cluster.http.ingress.OpenAIIngress (which imports this module)."""

    client: LLMClient
    lora: LoraCatalog


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's body; fields it has that kvray does not use (load_inplace) are ignored."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(BaseModel):
    """vLLM's body; its optional lora_int_id is ignored (the name says which)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str


async def model_list(ingress: Ingress) -> dict[str, Any]:
    """The body of GET /v1/models: the served model first, then its adapters."""
    card = await ingress.client.model_card()

    def entry(model_id: str, root: str, parent: str | None) -> dict[str, Any]:
        return {
            "id": model_id,
            "object": "model",
            "created": card["created"],
            "owned_by": OWNED_BY,
            "root": root,
            "parent": parent,
            "max_model_len": card["max_model_len"],
            # What the weights and the KV cache are stored as (an adapter runs on them too).
            "quantization": card.get("quantization", "none"),
            "kv_cache_dtype": card.get("kv_cache_dtype"),
        }

    data = [entry(card["id"], card["id"], None)]
    data += [entry(a.name, a.path, card["id"]) for a in await ingress.lora.adapters()]
    return {"object": "list", "data": data}


def add_lora_routes(app: FastAPI, ingress: Ingress) -> None:
    """Adds GET /v1/models, and the load and unload routes when runtime loading is on."""

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return await model_list(ingress)

    if not ingress.lora.runtime_loading:
        return

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoraAdapterRequest) -> str:
        adapter = await ingress.lora.load(body.lora_name, body.lora_path)
        return f"Success: LoRA adapter {adapter.name!r} loaded (id {adapter.lora_int_id})."

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest) -> str:
        await ingress.lora.unload(body.lora_name)
        return f"Success: LoRA adapter {body.lora_name!r} unloaded."

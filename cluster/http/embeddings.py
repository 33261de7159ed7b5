"""POST /v1/embeddings: OpenAI's request body, route and response, as vLLM serves them for a
decoder model.

The body is read here into the shared embedding preparation (cluster/ingress/embeddings.py)
and run like a completion by `OpenAIIngress.run` (admission, limits, routing, metrics, client
disconnects; one engine request per input), with `EmbeddingFormatter` answering.

Fields: OpenAI's `model`, `input` (a string, a list of strings, a list of token ids or a list
of those), `encoding_format` ("float", or "base64": little-endian float32 bytes, which the
openai client asks for by default), `dimensions` (only the model's own size), `user`
(accepted); vLLM's `normalize` and `truncate_prompt_tokens`; and `pooling_type` ("last" or
"mean": vLLM's pooler-config name, per request here).
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Strict

from cluster.ingress import embeddings
from cluster.ingress.embeddings import EmbedInput, EmbedOptions
from cluster.ingress.prepare import Prepared, Preparer
from cluster.ingress.tenants import current_tenant
from workers.lora.request import LoRARequest

Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]
EncodingFormat = Literal["float", "base64"]


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[str] | list[Int] | list[list[Int]]
    encoding_format: EncodingFormat = "float"
    dimensions: Int | None = None
    user: str | None = None
    # vLLM's extras
    normalize: Bool | None = None
    truncate_prompt_tokens: Int | None = None
    pooling_type: str | None = None

    def inputs(self) -> list[EmbedInput]:
        """The batch: one string, one token-id list, or a list of either. Errors name
        `input`; their messages say which one (input[2]) when there are several."""
        raw = self.input
        if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
            return [EmbedInput(raw, "input", "input")]  # type: ignore[arg-type]
        return [EmbedInput(v, "input", f"input[{i}]") for i, v in enumerate(raw)]  # type: ignore[arg-type]

    def options(self) -> EmbedOptions:
        return EmbedOptions(
            embeddings.pooling(self.pooling_type, self.normalize),
            self.truncate_prompt_tokens,
        )

    async def prepare(
        self,
        preparer: Preparer,
        hidden_size: int | None,
        *,
        lora: LoRARequest | None = None,
        tenant: str | None = None,
    ) -> Prepared:
        """The engine requests, one per input, under the adapter `lora` and for `tenant`;
        errors name the field (HTTP 400)."""
        embeddings.check_dimensions(self.dimensions, hidden_size)
        return await embeddings.prepare(
            preparer, self.inputs(), self.options(), "input", lora=lora, tenant=tenant
        )


class EmbeddingFormatter:
    """The answer of one /v1/embeddings request from its inputs' final outputs, in input
    order (what `OpenAIIngress.run` asks of a formatter that never streams)."""

    def __init__(
        self,
        request_id: str,
        model: str,
        encoding_format: EncodingFormat = "float",
        dimensions: int | None = None,
    ) -> None:
        self.id = request_id
        self.model = model
        self.encoding_format = encoding_format
        self.dimensions = dimensions  # checked against the vectors when set
        self.created = int(time.time())

    def response(self, finals: Sequence[Any]) -> dict[str, Any]:
        data = []
        for i, out in enumerate(finals):
            vector = embeddings.embedding_of(out, i)
            embeddings.check_dimensions(self.dimensions, len(vector))
            data.append({"object": "embedding", "index": i, "embedding": self.encode(vector)})
        tokens = sum(embeddings.prompt_tokens(out) for out in finals)
        return {
            "id": self.id,
            "object": "list",
            "created": self.created,
            "model": self.model,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    def encode(self, vector: Sequence[float]) -> list[float] | str:
        if self.encoding_format == "base64":
            return encode_base64(vector)
        return list(vector)


def encode_base64(vector: Sequence[float]) -> str:
    """Little-endian float32 bytes in base64: what OpenAI sends, and what its client decodes
    (with numpy's float32, or the array module's "f", both native order on every platform
    the client runs on)."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


def add_embeddings_route(app: FastAPI, ingress: Any) -> None:
    """Adds POST /v1/embeddings to `app`; the route closes over `ingress` (OpenAIIngress, not
    imported: it imports this module)."""

    @app.post("/v1/embeddings")
    async def create_embeddings(body: EmbeddingRequest) -> Any:
        # An adapter's name embeds with the adapter: its deltas apply to the prompt's rows.
        target = await ingress.lora.target(body.model)
        ingress.check_admitting()
        prepared = await body.prepare(
            ingress.preparer, ingress.embedding_size, lora=target.lora, tenant=current_tenant()
        )
        fmt = EmbeddingFormatter(
            f"embd-{uuid.uuid4().hex}", target.name, body.encoding_format, body.dimensions
        )
        return await ingress.run(fmt, prepared, False)

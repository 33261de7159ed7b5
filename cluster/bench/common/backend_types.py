"""What every backend of `kvray bench serve` shares: its context, its record, its shape.

A module of its own so each backend (backends.py, grpc_backend.py) imports it and the
dispatch in backends.py imports the backends, without a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from cluster.bench.common.workload import BenchRequest


@dataclass
class RequestRecord:
    """What one request measured (times in seconds from its send)."""

    ok: bool
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    cached_tokens: int = 0
    error: str = ""
    text: str = ""  # the streamed text (http): benches that compare outputs read it


@dataclass(frozen=True)
class BackendContext:
    """Everything a backend may need; each uses its part."""

    model: str  # the model id sent in requests
    model_dir: str  # checkpoint on this machine (inprocess; tokenizer for the workload)
    base_url: str | None = None  # http: e.g. http://127.0.0.1:8000
    grpc_address: str | None = None  # grpc: HOST:PORT
    api_key: str | None = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # inprocess EngineArgs extras
    torch_threads: int = 0  # inprocess: torch intra-op threads (0: torch's default)
    # inprocess: LoRA adapter name -> its directory (the requests' `model`: --workload lora).
    lora_modules: dict[str, str] = field(default_factory=dict)


class Backend(Protocol):
    name: str

    async def send(self, req: BenchRequest) -> RequestRecord: ...

    async def close(self) -> None: ...

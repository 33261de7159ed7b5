"""The errors of loading and unloading LoRA adapters at run time (docs/lora.md), with their
HTTP status and gRPC code like every cluster.errors class. A bad adapter or a missing field is
cluster.errors' InvalidRequestError (400 / INVALID_ARGUMENT); an unknown `model` its
ModelNotFoundError (404 / NOT_FOUND)."""

from __future__ import annotations

from cluster.errors import KvrayError


class LoraAdapterExistsError(KvrayError):
    """Load of a name already served (HTTP 400 as vLLM answers it, gRPC ALREADY_EXISTS)."""

    http_status = 400
    openai_type = "invalid_request_error"
    grpc_code = "ALREADY_EXISTS"

    def __init__(self, name: str) -> None:
        super().__init__(
            f"the LoRA adapter {name!r} is already loaded; unload it first to replace it",
            param="lora_name",
        )


class LoraAdapterNotFoundError(KvrayError):
    """Unload of a name that is not a loaded adapter (HTTP 404, gRPC NOT_FOUND)."""

    http_status = 404
    openai_type = "not_found_error"
    grpc_code = "NOT_FOUND"

    def __init__(self, name: str) -> None:
        super().__init__(f"the LoRA adapter {name!r} is not loaded", param="lora_name")


class RuntimeLoraOffError(KvrayError):
    """Load or unload on a server started without --enable-runtime-lora. Over HTTP the routes
    are absent (404, as vLLM); over gRPC the methods answer UNIMPLEMENTED with this."""

    http_status = 404
    openai_type = "not_found_error"
    grpc_code = "UNIMPLEMENTED"

    def __init__(self) -> None:
        super().__init__(
            "loading and unloading LoRA adapters is off: start the server with "
            "--enable-runtime-lora (enable_runtime_lora: true)"
        )


class LoraRegistryUnavailableError(KvrayError):
    """The application's adapter registry did not answer (HTTP 503, gRPC UNAVAILABLE): Ray
    restarts it; the load or unload may be retried."""

    http_status = 503
    openai_type = "service_unavailable"
    grpc_code = "UNAVAILABLE"

    def __init__(self, detail: str) -> None:
        super().__init__(f"the LoRA adapter registry is unavailable; retry: {detail}")

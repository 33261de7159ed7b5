"""Bounds on what one request may ask for, the same for the HTTP and gRPC ingresses.

Without them one request can stall a replica (n=100000 builds 100,000 sequences inside the
engine's step loop) or make the stop checker scan 100,000 strings at every token. Each bound
is a ServeConfig value (`kvray serve --max-n ...`); a request over one is an
InvalidRequestError (HTTP 400, gRPC INVALID_ARGUMENT) naming the field and the limit, raised
before anything is tokenized or routed. The HTTP body size is bounded before the body is
read (cluster/http/guard.py); gRPC messages by grpc_max_message_bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sized
from dataclasses import dataclass, fields
from typing import Any

from cluster.config import ServeConfig
from cluster.errors import InvalidRequestError


@dataclass(frozen=True)
class RequestLimits:
    """The bounds of one deployment; the fields are ServeConfig's of the same names, whose
    defaults (and flag help) are the only place they are written."""

    max_n: int
    max_stop_strings: int
    max_stop_string_chars: int
    max_stop_token_ids: int
    max_prompts_per_request: int
    max_chat_messages: int

    @staticmethod
    def from_config(config: ServeConfig) -> RequestLimits:
        return RequestLimits(
            **{f.name: getattr(config.limits, f.name) for f in fields(RequestLimits)}
        )

    def check_sampling(self, kwargs: Mapping[str, Any]) -> None:
        """The bounded SamplingParams keyword arguments (n, stop, stop_token_ids); checked
        before SamplingParams is built, so a huge list costs no more than its length."""
        n = kwargs.get("n")
        # Non-integers are SamplingParams' to reject, with its own message.
        if isinstance(n, int) and not isinstance(n, bool) and n > self.max_n:
            raise _over("n", n, self.max_n, "max_n")
        stop = kwargs.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop:
            if len(stop) > self.max_stop_strings:
                raise _over("stop", len(stop), self.max_stop_strings, "max_stop_strings", "strings")
            for s in stop:
                if isinstance(s, str) and len(s) > self.max_stop_string_chars:
                    raise _over(
                        "stop",
                        len(s),
                        self.max_stop_string_chars,
                        "max_stop_string_chars",
                        "characters in one string",
                    )
        ids = kwargs.get("stop_token_ids")
        if isinstance(ids, Sized) and len(ids) > self.max_stop_token_ids:
            raise _over(
                "stop_token_ids", len(ids), self.max_stop_token_ids, "max_stop_token_ids", "ids"
            )

    def check_prompts(self, count: int, field: str = "prompt") -> None:
        if count > self.max_prompts_per_request:
            raise _over(
                field, count, self.max_prompts_per_request, "max_prompts_per_request", "prompts"
            )

    def check_messages(self, count: int, field: str = "messages") -> None:
        if count > self.max_chat_messages:
            raise _over(field, count, self.max_chat_messages, "max_chat_messages", "messages")


DEFAULT_LIMITS = RequestLimits.from_config(ServeConfig())


def _over(field: str, got: int, limit: int, setting: str, what: str = "") -> InvalidRequestError:
    """'n is 500, over ...' / 'stop has 17 strings, over ...' naming the ServeConfig field."""
    size = f"has {got} {what}" if what else f"is {got}"
    return InvalidRequestError(
        field, f"{field} {size}, over this server's limit of {limit} ({setting})"
    )
